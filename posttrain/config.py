"""The post-training config: pretraining's sections plus `post` (method, data, chat format,
DPO and SGA settings), validated before any process group is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from models.attention.relu import reads_row_length
from models.config import ConfigError
from posttrain.chat import ChatFormat
from pretrain.config import Config, parse_paths

METHODS = ("sft", "dpo", "sga")
PREFERENCE_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")  # posttrain.losses.dpo_loss
REFERENCE_FREE = ("simpo", "orpo")  # losses of the policy alone: no reference model is held
SFT_TRUNCATION = ("drop", "keep_start", "keep_end")


@dataclass
class PostConfig:
    method: str = "sft"  # sft | dpo | sga
    # Training files (JSON Lines, .gz / .zst, or Parquet). sft: {"prompt", "response"} or {"messages"};
    # dpo / sga: {"prompt", "chosen", "rejected", "scores"} (posttrain.records).
    data: list[str] = field(default_factory=list, metadata={"parse": parse_paths})
    val_data: list[str] = field(default_factory=list, metadata={"parse": parse_paths})  # validation files
    max_len: int = 0  # input tokens per example (all but its last label); 0 = model.max_seq_len; longer: dropped
    # dpo / sga: a longer pair keeps its prompt's last max_prompt_len tokens (BOS first where one
    # begins it) and its responses' first tokens that fit, as TRL truncates (0: dropped)
    max_prompt_len: int = 0
    # sft: an example longer than post.max_len is dropped, or cut to fit as TRL's truncation_mode:
    # keep_start its first tokens (the last response loses its end and EOS), keep_end its last
    # ones (BOS first where one begins it); dropped still where no trained token is left
    sft_truncation: str = "drop"
    packing: bool = False  # sft: several examples per row, each attending only to itself
    # Chat rendering: each turn is prefix + content + turn_end; an assistant turn is assistant_prefix +
    # content + EOS, and only its content and EOS are trained.
    # (defaults: posttrain.chat.ChatFormat's, "System: ", "User: ", "Assistant: ", "\n")
    system_prefix: str = ChatFormat.system_prefix
    user_prefix: str = ChatFormat.user_prefix
    assistant_prefix: str = ChatFormat.assistant_prefix
    turn_end: str = ChatFormat.turn_end
    add_bos: bool = ChatFormat.add_bos  # start every example with BOS (tokenizers that expect one: Llama's)
    # The spaces that end assistant_prefix are encoded with the response, whose first word then gets
    # the token running text has (false: prefix and response encoded apart, as before this key).
    prefix_spaces_in_response: bool = ChatFormat.prefix_spaces_in_response
    beta: float = 0.1  # DPO temperature (orpo: the weight of the odds-ratio term, the paper's lambda)
    # DPO's (and SGA's) preference loss: sigmoid (DPO) | ipo | hinge | simpo | orpo (the last two
    # hold no reference model) (posttrain.losses.dpo_loss)
    preference_loss: str = "sigmoid"
    label_smoothing: float = 0.0  # sigmoid / simpo: the share of pairs taken as mislabelled (cDPO)
    simpo_gamma: float = 0.5  # simpo: the reward margin asked of the chosen response (TRL's default)
    # dpo / sga: the chosen responses' SFT loss added with this weight (TRL's rpo_alpha; with simpo,
    # CPO-SimPO's cpo_alpha); orpo has its own, weight 1
    sft_weight: float = 0.0
    # SGA: loss = dpo_weight x DPO(score-conditioned prompt) + mse_weight x MSE(value head on the raw prompt)
    dpo_weight: float = 1.0
    mse_weight: float = 1000.0
    value_head_layers: int = 3  # hidden layers of the value head MLP (ReLU), each value_head_width wide
    value_head_width: int = 1024
    value_head_dropout: float = 0.1  # on the hidden state the head reads
    # Scores as text, appended to the last user turn: prefix + joiner.join(item per objective)
    score_prefix: str = "\nYour response must satisfy the following scores: "
    score_item: str = "<{name}_score:{value}>"
    score_joiner: str = " and "
    score_decimals: int = 2  # scores are rounded to this many decimals, in the text and as targets


@dataclass
class PostTrainConfig(Config):
    post: PostConfig = field(default_factory=PostConfig)

    def rows_per_example(self) -> int:
        """SFT one, DPO a pair, SGA a pair and, with post.mse_weight, the raw prompt for the value head
        (posttrain.model)."""
        if self.post.method == "sft":
            return 1
        return 2 + (self.post.method == "sga" and self.post.mse_weight > 0)

    def tokens_per_row(self) -> int:
        return self.post.max_len or self.model.max_seq_len

    def holds_reference_model(self) -> bool:
        """DPO and SGA hold a frozen reference model beside the policy (posttrain.model), but with
        a reference-free loss (SimPO, ORPO)."""
        return self.post.method != "sft" and self.post.preference_loss not in REFERENCE_FREE


def validate_post(cfg: PostTrainConfig) -> None:
    """The `post` keys, and the pretraining keys post-training reads differently."""
    p = cfg.post
    if p.method not in METHODS:
        raise ConfigError(f"post.method={p.method!r}: choose one of {', '.join(METHODS)}")
    if not p.data:
        raise ConfigError("post.data is empty: list the training files, e.g. post.data=[data/sft.jsonl]")
    missing = [f for f in p.data + p.val_data if not Path(f).is_file()]
    if missing:
        raise ConfigError(f"post.data / post.val_data: no such file {', '.join(missing)}")
    if not cfg.train.init_from:
        raise ConfigError("post-training starts from a trained model (and DPO / SGA keep it as the reference): "
                          "set train.init_from to a checkpoint (RUN_DIR or RUN_DIR/checkpoints/TAG)")
    if p.max_len < 0 or p.max_len > cfg.model.max_seq_len:
        raise ConfigError(f"post.max_len={p.max_len} must be between 0 (= model.max_seq_len) and "
                          f"model.max_seq_len={cfg.model.max_seq_len}")
    if p.max_prompt_len and p.method == "sft":
        raise ConfigError(f"post.max_prompt_len={p.max_prompt_len} cuts preference pairs (post.method=dpo or sga); "
                          "SFT examples are cut by post.sft_truncation: leave post.max_prompt_len out")
    if p.max_prompt_len and not 0 < p.max_prompt_len < (p.max_len or cfg.model.max_seq_len):
        raise ConfigError(f"post.max_prompt_len={p.max_prompt_len}: for post.method=dpo or sga, below post.max_len "
                          f"(or model.max_seq_len: {p.max_len or cfg.model.max_seq_len}) to leave the responses room; "
                          "0 drops the pairs that do not fit")
    if p.sft_truncation not in SFT_TRUNCATION:
        raise ConfigError(f"post.sft_truncation={p.sft_truncation!r}: choose one of {', '.join(SFT_TRUNCATION)}")
    if p.sft_truncation != "drop" and p.method != "sft":
        raise ConfigError(f"post.sft_truncation={p.sft_truncation} is for post.method=sft; {p.method} cuts long "
                          "pairs with post.max_prompt_len: set post.sft_truncation=drop")
    if p.packing and p.method != "sft":
        raise ConfigError(f"post.packing=true is for post.method=sft; {p.method} pairs each prompt with two "
                          "responses, padded: set post.packing=false")
    if p.beta <= 0:
        raise ConfigError(f"post.beta={p.beta} must be > 0 (0.1 is usual)")
    if p.preference_loss not in PREFERENCE_LOSSES:
        raise ConfigError(f"post.preference_loss={p.preference_loss!r}: choose one of {', '.join(PREFERENCE_LOSSES)}")
    if not 0 <= p.label_smoothing < 0.5 or (p.label_smoothing and p.preference_loss not in ("sigmoid", "simpo")):
        raise ConfigError(f"post.label_smoothing={p.label_smoothing} must be in [0, 0.5) (the share of pairs taken "
                          "as mislabelled; 0.5 would learn nothing) and is for post.preference_loss=sigmoid or simpo")
    if p.simpo_gamma != PostConfig.simpo_gamma and p.preference_loss != "simpo":
        raise ConfigError(f"post.simpo_gamma={p.simpo_gamma} is for post.preference_loss=simpo; leave it out")
    if p.sft_weight < 0:
        raise ConfigError(f"post.sft_weight={p.sft_weight} must be >= 0 (the weight of the chosen responses' SFT loss)")
    if p.sft_weight and p.method == "sft":
        raise ConfigError(f"post.sft_weight={p.sft_weight} adds an SFT term to a preference loss (post.method=dpo or "
                          "sga); post.method=sft is that loss alone: leave post.sft_weight out")
    if p.sft_weight and p.preference_loss == "orpo":
        raise ConfigError(f"post.sft_weight={p.sft_weight}: post.preference_loss=orpo has its own SFT term at weight 1: "
                          "leave post.sft_weight out")
    if p.method == "sft" and (p.preference_loss != PostConfig.preference_loss or p.label_smoothing):
        raise ConfigError(f"post.preference_loss={p.preference_loss} / post.label_smoothing={p.label_smoothing} are "
                          "for post.method=dpo or sga; SFT trains on the responses alone: leave them out")
    if cfg.holds_reference_model() and cfg.model.mlp in ("moe", "uoe") and cfg.model.moe.capacity_factor > 0:
        raise ConfigError(f"model.moe.capacity_factor={cfg.model.moe.capacity_factor}: {p.method}'s frozen reference "
                          "routes every token (it runs in evaluation mode), so a policy that drops tokens over "
                          "capacity would differ from it by the drops alone; set model.moe.capacity_factor=0 "
                          "(it changes no weight), or a loss without a reference (post.preference_loss=simpo or orpo)")
    if p.dpo_weight < 0 or p.mse_weight < 0 or p.dpo_weight + p.mse_weight == 0:
        raise ConfigError(f"post.dpo_weight={p.dpo_weight} and post.mse_weight={p.mse_weight} must be >= 0 "
                          "and not both 0")
    if p.value_head_layers < 0 or p.value_head_width < 1 or not 0 <= p.value_head_dropout < 1:
        raise ConfigError("post.value_head_layers must be >= 0, post.value_head_width >= 1 and "
                          "post.value_head_dropout in [0, 1)")
    try:  # the text must tell objectives and values apart (format specs such as {value:.2f} are fine)
        probes = {p.score_item.format(name=name, value=value) for name in ("a", "b") for value in (0.25, 0.75)}
    except (KeyError, IndexError, ValueError, TypeError):
        probes = set()
    if len(probes) < 4:
        raise ConfigError(f"post.score_item={p.score_item!r} must hold {{name}} and {{value}} (and nothing else in "
                          "braces; a format spec such as {value:.2f} may follow value), e.g. "
                          "post.score_item='<{name}_score:{value}>'")
    if p.score_decimals < 0:
        raise ConfigError(f"post.score_decimals={p.score_decimals} must be >= 0")
    if p.method == "sga" and p.mse_weight == 0:
        raise ConfigError("post.method=sga with post.mse_weight=0 would leave the value head untrained; give it a "
                          "weight (1000 in the reference runs) or use post.method=dpo")
    # Pretraining keys the post-training loss does not apply: refused rather than ignored.
    if cfg.train.z_loss:
        raise ConfigError(f"train.z_loss={cfg.train.z_loss} is not applied in post-training; set train.z_loss=0")
    if cfg.data.start_with_bos and not p.add_bos:
        raise ConfigError("data.start_with_bos=true: post-training starts its examples with BOS by post.add_bos; "
                          "set post.add_bos=true (as the pretraining samples began) or data.start_with_bos=false")
    if reads_row_length(cfg.model):
        raise ConfigError("model.relu_attention.normalizer=seqlen divides by the padded row length, so an example's "
                          "loss would depend on the others in its micro-batch: a model trained with it cannot be "
                          "post-trained here (prefix and content can)")
    if cfg.eval.sample_prompts:
        raise ConfigError("eval.sample_prompts continues plain text, not conversations in post-training's chat "
                          "format: leave it out, and sample with python -m tools.generate (or tools.sga_generate)")
    if cfg.eval.val_sets:
        raise ConfigError("eval.val_sets holds pretraining shard sets; post-training validates on post.val_data: "
                          "leave eval.val_sets out")
    if cfg.data.document_mask:
        raise ConfigError("data.document_mask=true is for pretraining shards; post-training masks each example "
                          "itself (post.packing): set data.document_mask=false")


def example_length(cfg: PostTrainConfig) -> int:
    """Tokens an example may have: inputs of up to max_len tokens plus the last label."""
    return (cfg.post.max_len or cfg.model.max_seq_len) + 1
