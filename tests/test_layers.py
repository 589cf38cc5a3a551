"""The packages depend on each other in one direction only, and the Slurm helpers stay torch-free."""

import ast
import subprocess
import sys

from tests.dist_utils import REPO, child_env

PACKAGES = ("models", "data_prep", "pretrain", "posttrain", "launch", "tools", "bench")
# What each package must not import. Everything else is allowed (launch and tools may use the
# library below them, bench may use anything).
FORBIDDEN = {
    "models": {"pretrain", "posttrain", "launch", "data_prep", "tools", "bench"},
    "data_prep": {"models", "pretrain", "posttrain", "launch", "tools", "bench"},
    "pretrain": {"posttrain", "launch", "tools", "bench"},
    "posttrain": {"launch", "tools", "bench"},
    "launch": {"tools", "bench"},
    "tools": {"bench"},
}


def imported_packages(path) -> set[tuple[int, str]]:
    """(line, top-level package) of every absolute import in a file, nested ones included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {(node.lineno, alias.name.split(".")[0]) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add((node.lineno, node.module.split(".")[0]))
    return found


def test_imports_point_one_way():
    wrong = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((REPO / package).rglob("*.py")):
            for line, target in imported_packages(path):
                if target in forbidden:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_the_check_sees_nested_imports(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import os\n\ndef f():\n    from pretrain.config import load_config\n")
    assert imported_packages(path) == {(1, "os"), (4, "pretrain")}


def test_slurm_helpers_do_not_load_torch():
    """launch.slurm_job runs in every Slurm job step and launch.status on login nodes: the
    checkpoint format they read must come without torch."""
    probe = ("import sys, launch.slurm_job, launch.status, pretrain.checkpoint_format; "
             "print(sorted(m for m in ('torch', 'numpy', 'deepspeed') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, env=child_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


TOOLS = sorted(p.stem for p in (REPO / "tools").glob("*.py") if p.stem not in ("__init__", "cli"))


def test_every_tool_answers_help(capsys):
    """`python -m tools.<name> --help` for every command-line tool (its main, in this process)."""
    import importlib

    import pytest

    assert len(TOOLS) >= 9
    for name in TOOLS:
        main = importlib.import_module(f"tools.{name}").main
        with pytest.raises(SystemExit) as exit_info:
            main(["--help"])
        assert exit_info.value.code == 0, name
        assert capsys.readouterr().out.startswith(f"usage: python -m tools.{name}"), name
