"""Rank layout from the launcher's environment: torchrun's variables, or Slurm's under srun."""

import json
import os
import subprocess
import sys

import pytest

from tests.dist_utils import REPO

PROBE = ("import json, os; from pretrain.distributed import read_env; e = read_env(); "
         "print(json.dumps([e.__dict__, {k: os.environ[k] for k in "
         "('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')}]))")


def probe(env: dict) -> tuple[dict, dict]:
    base = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True,
                         check=True, cwd=REPO)
    return tuple(json.loads(out.stdout.strip().splitlines()[-1]))


def test_slurm_variables_map_to_torchrun_names():
    layout, exported = probe({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
                              "SLURM_NTASKS_PER_NODE": "4(x2)"})
    assert layout == {"rank": 5, "world_size": 8, "local_rank": 1, "local_world_size": 4}
    assert exported == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


def test_torchrun_variables_win_over_slurm():
    layout, _ = probe({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2",
                       "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    assert layout == {"rank": 1, "world_size": 2, "local_rank": 1, "local_world_size": 2}


def test_under_slurm_the_first_node_hosts_the_rendezvous_store():
    """torch guesses the c10d store's host from the endpoint address, wrongly for a second
    interface's address or a loopback one: the agent of SLURM_NODEID 0 is told it hosts, the others
    that they do not, inside any --rdzv-conf given (an is_host given stays)."""
    from launch.torchrun import with_store_host

    agent = ["--nnodes=2", "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29500", "-m", "pretrain.train"]
    assert with_store_host(agent, "0") == ["--rdzv-conf=is_host=1", *agent]
    assert with_store_host(agent, "3") == ["--rdzv-conf=is_host=0", *agent]
    assert with_store_host(agent, None) == agent  # not under Slurm: torch's own rule
    spaced = ["--nnodes", "2", "--rdzv-conf", "read_timeout=8", "-m", "x", "--rdzv-conf=y"]
    assert with_store_host(spaced, "1") == ["--nnodes", "2", "--rdzv-conf", "read_timeout=8,is_host=0", "-m", "x",
                                            "--rdzv-conf=y"]  # the script's own arguments untouched
    assert with_store_host(["--rdzv_conf=timeout=9", "train.py"], "0") == ["--rdzv_conf=timeout=9,is_host=1",
                                                                           "train.py"]
    given = ["--rdzv-conf=is_host=1", "-m", "x"]
    assert with_store_host(given, "1") == given
    assert with_store_host(["--rdzv-conf=", "-m", "x"], "0") == ["--rdzv-conf=is_host=1", "-m", "x"]


def test_a_signal_before_the_workers_start_stops_the_agent_with_its_own_code(tmp_path):
    """A time-limit signal while the agent waits in a two-node rendezvous (or imports torch) stops it
    with launch.torchrun.NOT_STARTED, which the batch script reads as a step never started; without
    the agent's early handler the signal killed it (exit 138, read as a failure)."""
    import signal
    import time

    from launch.torchrun import NOT_STARTED
    from tests.dist_utils import child_env, free_port

    script = tmp_path / "never.py"
    script.write_text("raise SystemExit('a worker started')\n")
    agent = subprocess.Popen([sys.executable, "-m", "launch.torchrun", "--nnodes=2", "--nproc-per-node=1",
                              "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=early",
                              "--signals-to-handle=SIGTERM,SIGUSR1", str(script)],
                             cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        usr1 = 1 << (signal.SIGUSR1 - 1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the handler is in place once the process catches SIGUSR1
            caught = [line for line in open(f"/proc/{agent.pid}/status") if line.startswith("SigCgt:")]
            if caught and int(caught[0].split()[1], 16) & usr1:
                break
            time.sleep(0.05)
        time.sleep(2)
        agent.send_signal(signal.SIGUSR1)
        out = agent.communicate(timeout=120)[0]
    finally:
        agent.kill()
    assert agent.returncode == NOT_STARTED, out[-2000:]
    assert "torchrun agent: stopped on signal SIGUSR1 before its workers started" in out


def test_a_signal_forwarded_before_the_step_existed_stops_the_agent_as_it_starts(tmp_path):
    """The batch script writes a forwarded signal's name to PRETRAIN_SIGNAL_FILE first: while srun
    still registers the step, scancel reaches no process of it, and the agent, once started, must
    not train. Without the file the same agent runs its worker."""
    from launch.torchrun import NOT_STARTED, SIGNAL_FILE_ENV
    from tests.dist_utils import child_env

    script = tmp_path / "worker.py"
    script.write_text("print('worker ran')\n")
    signal_file = tmp_path / "SIGNAL_FORWARDED"
    agent = [sys.executable, "-m", "launch.torchrun", "--standalone", "--nproc-per-node=1", str(script)]
    env = {**child_env(), SIGNAL_FILE_ENV: str(signal_file)}

    ran = subprocess.run(agent, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0 and "worker ran" in ran.stdout, ran.stdout + ran.stderr[-2000:]
    signal_file.write_text("SIGTERM\n")
    stopped = subprocess.run(agent, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert stopped.returncode == NOT_STARTED, stopped.stderr[-2000:]
    assert "SIGTERM was forwarded to this step before it started" in stopped.stderr
    assert "worker ran" not in stopped.stdout


def test_local_launch_applies_the_single_gpu_layout_before_the_overrides(tmp_path, capsys):
    import socket

    from launch.layouts import read_layouts
    from launch.local import main as local_main
    from tests.synthetic import write_synthetic_shards

    data = write_synthetic_shards(tmp_path / "data")
    fit_data = [f"data.shards={data / 'shards'}", f"data.tokenizer={data / 'tokenizer'}",
                "model.vocab_size=256", "model.max_seq_len=32"]
    config = "configs/1b_uoe.yaml"
    single = read_layouts(REPO / config).single_gpu
    assert "parallel.expert=1" in single and any(kv.startswith("train.micro_batch=") for kv in single)
    assert local_main([config, "--single-gpu", "--dry-run", "train.micro_batch=2", *fit_data]) == 0
    command = capsys.readouterr().out.split()
    tail = command[command.index(config) + 1:]
    assert tail == [*single, "train.micro_batch=2", *fit_data]  # the caller's overrides win
    # Without the layout the file's 8-GPU expert layout does not fit one process.
    assert local_main([config, "--dry-run", *fit_data]) == 2
    err = capsys.readouterr().err
    assert "not divisible by parallel.expert=8" in err and "--single-gpu applies the config header's layout" in err
    assert local_main([config, "--dry-run", "--port", "70000", *single, *fit_data]) == 2
    assert "--port 70000: give a port from 1 to 65535" in capsys.readouterr().err
    with socket.socket() as held:  # another run's rendezvous
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        assert local_main(["configs/tiny_dense.yaml", "--port", str(port), *fit_data]) == 2
        assert f"--port {port} is in use (another run on this machine?)" in capsys.readouterr().err
    assert local_main(["configs/tiny_dense.yaml", "--single-gpu", "--dry-run", *fit_data]) == 2
    assert "has no '# single-gpu (80-141 GB):' line" in capsys.readouterr().err
    assert local_main([config, "--single-gpu", "--nproc", "2", "--dry-run", *fit_data]) == 2
    assert "runs one process" in capsys.readouterr().err
    # The checkpoints a run would resume or start from are checked as the run checks them.
    for bad in (f"train.resume={tmp_path / 'none_here'}", f"train.init_from={tmp_path / 'none_here'}"):
        assert local_main(["configs/tiny_dense.yaml", "--dry-run", *fit_data, bad]) == 2
        assert f"{tmp_path / 'none_here'}" in capsys.readouterr().err


def test_reading_a_config_prints_nothing():
    """launch/demo.sh and job scripts read config values from stdout: loading a config (which
    imports every kind, DeepSpeed's experts included) must print nothing there."""
    code = "from pretrain.config import load_config; print(load_config('configs/demo.yaml').train.steps)"
    out = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout == "300\n"


def test_the_demo_names_a_mistaken_override_before_building_its_data(tmp_path):
    """launch/demo.sh reads its config and overrides before it trains a tokenizer and builds shards
    (minutes on a fresh DEMO_DATA): a typo is named at once, as an error, with nothing built."""
    out = subprocess.run(["bash", "launch/demo.sh", "configs/demo.yaml", "train.lrr=1"], cwd=REPO, text=True,
                         env={**os.environ, "DEMO_DATA": str(tmp_path / "demo")}, capture_output=True)
    assert out.returncode != 0 and "error: unknown config key 'train.lrr'" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "demo").exists()
    # It starts its run directory afresh, but never one it did not write: that is refused, kept whole
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "weights.pt").write_text("trained for a week")
    out = subprocess.run(["bash", "launch/demo.sh", "configs/demo.yaml", f"run.dir={tmp_path / 'precious'}"],
                         cwd=REPO, text=True, env={**os.environ, "DEMO_DATA": str(tmp_path / "demo")},
                         capture_output=True)
    assert out.returncode == 2 and "holds files this demo did not write" in out.stderr
    assert (tmp_path / "precious" / "weights.pt").read_text() == "trained for a week"
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT"])
def test_the_console_shows_each_warning_once_and_a_signal_to_the_launcher_saves(tmp_path, stop):
    """launch.local: the console shows each warning once and other ranks write their own log; a
    SIGTERM sent to the launcher (kill, timeout, srun --signal) reaches the torchrun agent it
    becomes, and every rank saves and stops; so does Ctrl-C in its terminal (SIGINT to the whole
    process group: the workers get it from the terminal and from the agent)."""
    import re
    import signal
    from collections import Counter

    from tests.dist_utils import child_env, free_port
    from tests.synthetic import tiny_overrides, write_synthetic_shards

    data = write_synthetic_shards(tmp_path / "data")
    run = tmp_path / "run"
    overrides = tiny_overrides(data, run, **{"train.steps": 1000, "train.eval_interval": 2, "train.warmup_steps": 1,
                                             "train.save_interval": 1000})
    launcher = subprocess.Popen([sys.executable, "-m", "launch.local", "configs/tiny_dense.yaml", "--nproc", "2",
                                 "--port", str(free_port()), *overrides], cwd=REPO, env=child_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    console, signum = [], getattr(signal, stop)
    try:
        for line in launcher.stdout:
            console.append(line.rstrip("\n"))
            if "step 3/1000" in line:
                if signum == signal.SIGINT:  # as a terminal's Ctrl-C: the foreground process group
                    os.killpg(launcher.pid, signum)
                else:
                    launcher.send_signal(signum)
                break
        console += launcher.communicate(timeout=300)[0].splitlines()
    finally:
        launcher.kill()
    assert launcher.returncode == 128 + signum, "\n".join(console[-40:])  # as a stopped agent exits
    assert f"torchrun agent: stopped on signal {stop}; the workers had it and up to --shutdown-timeout to save" \
        in console
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in console)
    assert any(f"on {stop}; resume with train.resume=auto" in line for line in console)
    assert (run / "checkpoints" / "latest").is_file()
    # A torch log line carries its time and pid; the message is what repeats.
    messages = [re.sub(r"^[WIE]\d{4} [\d:.]+ \d+ ", "", line) for line in console
                if "Warning" in line or re.match(r"^[WIE]\d{4} ", line)]
    assert messages and max(Counter(messages).values()) == 1, Counter(messages).most_common(3)
    assert sum("step 2/1000" in line for line in console) == 1
    rank1 = (run / "logs" / "rank1.log").read_text()
    assert "Transformer Engine and Apex are not installed" in rank1 and "step 2/1000" not in rank1


def test_another_ranks_crash_still_reaches_the_terminal(tmp_path):
    code = ("from pretrain import rank_logs; rank_logs.quiet_other_ranks(); print('chatter'); "
            f"rank_logs.settle({str(tmp_path)!r}); raise RuntimeError('boom')")
    res = subprocess.run([sys.executable, "-c", code], env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO),
                                                            "RANK": "1"}, capture_output=True, text=True, cwd=REPO)
    assert res.returncode == 1 and "chatter" not in res.stdout + res.stderr
    assert "[rank 1] Traceback" in res.stderr and "RuntimeError: boom" in res.stderr
    log = (tmp_path / "logs" / "rank1.log").read_text()
    assert "chatter" in log and "RuntimeError: boom" in log and str(tmp_path / "logs" / "rank1.log") in res.stderr


def fake_run(run_dir, steps: int, stop_at_step: int, saved_step: int):
    """A run directory with a config and one complete checkpoint (what decide reads)."""
    (run_dir / "checkpoints" / f"step_{saved_step:08d}").mkdir(parents=True)
    (run_dir / "checkpoints" / f"step_{saved_step:08d}" / "COMPLETE").write_text(json.dumps({"step": saved_step}))
    (run_dir / "config.yaml").write_text(f"train:\n  steps: {steps}\n  stop_at_step: {stop_at_step}\n")


def test_a_job_that_reached_stop_at_step_is_done_whatever_its_exit_code(tmp_path):
    from launch.slurm_job import decide

    fake_run(tmp_path / "stopped", steps=10, stop_at_step=4, saved_step=4)
    fake_run(tmp_path / "short", steps=10, stop_at_step=0, saved_step=4)
    # A signal after the stop's save: the agents exit non-zero, but the job's work is complete.
    assert decide(tmp_path / "stopped", 1, "USR1", 0, 3)[0] == "done"
    assert decide(tmp_path / "short", 1, "USR1", 0, 3)[0] == "failed"
    assert decide(tmp_path / "short", 0, "", 0, 3)[0] == "done"
    # A signal before the training step started: nothing was lost, the time limit requeues.
    assert decide(tmp_path / "short", 0, "USR1", 0, 3, started=False)[0] == "requeue"
    assert decide(tmp_path / "short", 0, "USR1", 3, 3, started=False)[0] == "stopped"
    assert decide(tmp_path / "short", 0, "TERM", 0, 3, started=False)[0] == "stopped"


def test_a_failed_job_run_is_retried_while_it_makes_progress(tmp_path):
    """A training step that failed (a lost node, a crashed rank) after saving a newer checkpoint than
    its job run started from is requeued to resume it, at most --max-retries times per job; one that
    saved nothing new would fail the same way again."""
    from launch.slurm_job import HISTORY, decide

    run = tmp_path / "run"
    fake_run(run, steps=100, stop_at_step=0, saved_step=40)
    history = run / HISTORY

    def job_run(start_tag: str, end_action: str | None = None, job: str = "7") -> None:
        with open(history, "a") as f:
            f.write(f"2026-12-07T10:00:00Z job={job} restarts=0 start nodes=n[1-2] saved={start_tag}\n")
            if end_action:
                f.write(f"2026-12-07T11:00:00Z job={job} restarts=0 end rc=1 signal=none action={end_action}\n")

    job_run("step_00000020")
    action, reason = decide(run, 1, "", 0, 10, job="7", max_retries=2)
    assert action == "retry" and "newer than step 20 this job run started from: retry 1 of at most 2" in reason
    assert decide(run, 1, "", 0, 10, job="7", max_retries=0)[0] == "failed"  # retries off
    history.write_text("")
    job_run("step_00000040")  # started from the checkpoint it still has: no progress
    assert decide(run, 1, "", 0, 10, job="7", max_retries=2) == \
        ("failed", "training step exited 1 without a signal save; latest complete checkpoint: step 40, as when this "
                   "job run started: not retrying")
    history.write_text("")
    job_run("none", "retry")
    job_run("step_00000010", "retry")
    job_run("step_00000010", "retry", job="6")  # another job's retries are its own
    job_run("step_00000030")
    assert "retried 2 times after failures (max 2)" in decide(run, 1, "", 0, 10, job="7", max_retries=2)[1]
    assert decide(run, 1, "", 0, 10, job="7", max_retries=3)[0] == "retry"


def test_the_history_records_the_signal_a_step_stopped_on(tmp_path, capsys):
    """slurm_history.log's signal: the batch shell's, else (a signal sent straight to the step, which
    the shell never sees) the trainer's stop marker's."""
    from launch.slurm_job import main as slurm_job_main
    from pretrain.checkpoint_format import write_stop_marker

    fake_run(tmp_path, steps=10, stop_at_step=0, saved_step=4)

    def decision(*args: str) -> str:
        assert slurm_job_main(["decide", str(tmp_path), "--restarts", "0", "--max-requeues", "3", *args]) == 0
        return capsys.readouterr().out.splitlines()[-1]

    assert decision("--rc", "1") == "failed none"
    write_stop_marker(tmp_path, 4, "SIGTERM")
    assert decision("--rc", "143") == "stopped TERM"
    assert decision("--rc", "138", "--received", "USR1") == "requeue USR1"
    assert decision("--rc", "0", "--received", "USR1", "--started", "0") == "requeue USR1"
    write_stop_marker(tmp_path, 4, "SIGALRM")  # train.stop_after_minutes: a time limit of the run's own
    assert decision("--rc", "138") == "requeue ALRM"


def test_a_stop_signal_while_the_trainer_imports_waits_for_the_first_step(tmp_path):
    """SIGUSR1 (a Slurm time limit) reaching pretrain.train while it still imports torch is kept for
    the first step boundary, where it saves and stops (85), not its default action (death by the
    signal, which the batch script reads as a failed job); the resource tracker it starts for the
    loaders' shared memory ignores the stop signals."""
    import signal
    import time

    from tests.dist_utils import child_env
    from tests.synthetic import tiny_overrides, write_synthetic_shards

    data, run = write_synthetic_shards(tmp_path / "data"), tmp_path / "run"
    trainer = subprocess.Popen([sys.executable, "-m", "pretrain.train", *tiny_overrides(data, run)], cwd=REPO,
                               env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    usr1, hup = 1 << (signal.SIGUSR1 - 1), 1 << (signal.SIGHUP - 1)

    def caught(pid: int) -> int:
        fields = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
        return int(fields["SigCgt"], 16)

    deadline = time.monotonic() + 30
    while not caught(trainer.pid) & usr1 and time.monotonic() < deadline:  # the handler, before torch loads
        time.sleep(0.01)
    assert "torch" not in open(f"/proc/{trainer.pid}/maps").read()  # still importing
    ignored = []
    for pid in filter(str.isdigit, os.listdir("/proc")):  # its child: the resource tracker
        try:
            if open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == str(trainer.pid):
                fields = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines())
                ignored.append(int(fields["SigIgn"], 16))
        except (FileNotFoundError, ProcessLookupError, IndexError):  # a process that ended meanwhile
            continue
    assert ignored and all(mask & usr1 and mask & hup for mask in ignored), ignored
    trainer.send_signal(signal.SIGUSR1)
    out = trainer.communicate(timeout=300)[0]
    assert trainer.returncode == 85, out[-3000:]
    assert "stopping at step 1 on SIGUSR1" in out and (run / "checkpoints" / "step_00000001").is_dir()
