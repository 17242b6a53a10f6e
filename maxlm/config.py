"""Typed, closed configuration: frozen dataclasses bound by gin.

A gin file binds fields of the dataclasses below (``ModelConfig.d_model = 512``).
``load(path, bindings)`` parses it, builds one ``Config`` and validates it before anything is
compiled. Every mistake a user can make in a config surfaces as a ``ConfigError`` whose message is
one line naming the file, the field and the values at fault; the CLIs print that line and exit 2.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from pathlib import Path
from typing import Any

import gin

from maxlm import rules

from maxlm.posttrain_config import POSTTRAIN_RANGES, DistillConfig, DPOConfig, GRPOConfig, RewardConfig, SFTConfig, check_posttrain

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# A config may `include 'sft_tiny.gin'`: gin looks for included files here too.
gin.add_config_file_search_path(str(CONFIG_DIR))


# Implementations of the linear seam (maxlm.model.linear registers one function per name).
LINEAR_IMPLS = ("dense", "int8", "int4")
# The weight-only quantized ones (packed ``qweight`` + ``scales``), also open to the embedding.
QUANT_IMPLS = ("int8", "int4")


class ConfigError(ValueError):
    """A user-facing configuration mistake; str(err) is the one line to print."""


@gin.configurable
@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The transformer. One code path covers the Llama and GPT-2/3 families."""

    vocab_size: int = 259
    vocab_multiple: int = 128  # embedding rows are padded to a multiple of this (Megatron-style)
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 0  # 0 means n_heads (multi-head attention); fewer gives grouped-query attention
    head_dim: int = 0  # 0 means d_model // n_heads
    d_ff: int = 1024
    max_seq_len: int = 2048
    norm: str = "rms"  # rms | layer
    norm_eps: float = 1e-5
    activation: str = "swiglu"  # swiglu | gelu (GPT's tanh approximation)
    position: str = "rope"  # rope | learned
    rope_theta: float = 10000.0
    # Llama-3 long-context frequency scaling; factor 0 turns it off.
    rope_scaling_factor: float = 0.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    use_bias: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.02
    dtype: str = "bfloat16"  # compute dtype: float32 | bfloat16 | float16
    param_dtype: str = "float32"
    remat: str = "none"  # none | full | save_dots | save_named
    attention_impl: str = "xla"  # xla | cudnn | pallas
    # Attend only to the last sliding_window positions (Mistral); 0 attends to the whole prefix.
    sliding_window: int = 0
    # The implementation behind every weight matmul (maxlm.model.linear); LoRA and quantized
    # variants register there under their own names.
    linear: str = "dense"
    # Per-Linear overrides of ``linear``: (regex, implementation) pairs; the first regex that
    # re.search-es a Linear's path wins. Paths drop the layer stack's prefix, so a rule covers
    # every layer alike: attn/q_proj, attn/k_proj, attn/v_proj, attn/o_proj, mlp/gate_proj,
    # mlp/up_proj, mlp/down_proj, lm_head (see ``linear_inputs``). E.g. (("mlp/", "int8"),).
    linear_rules: tuple[tuple[str, str], ...] = ()
    quant_group: int = 128  # int4: inputs per scale (a multiple of 8 dividing each quantized input)
    int8_group: int = 0  # int8: inputs per scale; 0 is one scale per output channel
    # The token embedding's storage: dense, or int8/int4 rows dequantized at lookup (stored as the
    # transposed table in the Linear format, so a tied LM head is that quantized Linear).
    embedding: str = "dense"
    # LoRA (maxlm.model.lora): low-rank adapters A [in, r] and B [r, out] beside every Linear whose
    # path lora_targets re.search-es, y = x W + (lora_alpha / lora_rank) dropout(x) A B. They add to
    # whatever implementation the Linear has, so LoRA over an int4 base is QLoRA. 0 = no adapters.
    # A run with adapters trains only them (the base is frozen and has no optimizer state).
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_dropout: float = 0.0  # on the adapters' input while training; evaluation never drops
    lora_targets: str = r"attn/(q|v)_proj$"  # e.g. "attn/|mlp/" for every attention and MLP Linear

    def __post_init__(self):
        # gin writes lists where Python writes tuples: keep the frozen config hashable.
        rules = self.linear_rules
        if isinstance(rules, list) or (isinstance(rules, tuple) and any(isinstance(r, list) for r in rules)):
            object.__setattr__(self, "linear_rules",
                               tuple(tuple(r) if isinstance(r, list) else r for r in rules))

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def padded_vocab(self) -> int:
        return -(-self.vocab_size // self.vocab_multiple) * self.vocab_multiple

    def linear_inputs(self) -> dict[str, tuple[str, int, str]]:
        """Every Linear's path (as ``linear_rules`` match it) -> (the field that sets its input size,
        that size, the logical name of its first input axis); a test checks it against the model."""
        d = ("ModelConfig.d_model", self.d_model, "embed")
        out = {"attn/q_proj": d, "attn/k_proj": d, "attn/v_proj": d,
               "attn/o_proj": ("ModelConfig.n_heads * head_dim", self.n_heads * self.dim_per_head, "heads")}
        if self.activation == "swiglu":
            out["mlp/gate_proj"] = d
        out.update({"mlp/up_proj": d, "mlp/down_proj": ("ModelConfig.d_ff", self.d_ff, "mlp"), "lm_head": d})
        return out

    def lora_paths(self) -> list[str]:
        """The Linear paths that carry adapters (none without lora_rank; a tied head has no kernel)."""
        if not self.lora_rank:
            return []
        return [p for p in self.linear_inputs() if re.search(self.lora_targets, p)
                and not (p == "lm_head" and self.tie_embeddings)]

    def linear_impl(self, path: str) -> str:
        """The implementation of the Linear at ``path``: the first matching rule's, else ``linear``."""
        for pattern, impl in self.linear_rules:
            if re.search(pattern, path):
                return impl
        return self.linear

    def quant_group_of(self, impl: str, n_in: int) -> int:
        """Inputs per scale of a quantized weight with ``n_in`` inputs."""
        return self.quant_group if impl == "int4" else (self.int8_group or n_in)

    def logical_sizes(self) -> dict[str, tuple[str, int]]:
        """The size of every logical weight axis (``maxlm.rules``), with the field that sets it.

        Each logical name has one size per model, which a test checks against every parameter of
        the real tree; the mesh divisibility rules follow from these and the rules table."""
        return {"heads": ("ModelConfig.n_heads", self.n_heads),
                "kv_heads": ("ModelConfig.n_kv_heads", self.kv_heads),
                "mlp": ("ModelConfig.d_ff", self.d_ff),
                "vocab": ("ModelConfig.padded_vocab", self.padded_vocab),
                "embed": ("ModelConfig.d_model", self.d_model),
                "act_embed": ("ModelConfig.d_model", self.d_model),
                "head_dim": ("ModelConfig.head_dim", self.dim_per_head),
                "layers": ("ModelConfig.n_layers", self.n_layers),
                "lora_rank": ("ModelConfig.lora_rank", self.lora_rank),
                "length": ("ModelConfig.max_seq_len", self.max_seq_len)}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Degrees of the four mesh axes; one degree may be -1 to take the remaining devices."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1
    pipeline: int = 1
    # Pipeline parallelism (used when pipeline > 1; see maxlm/parallel/pipeline_parallel.py). The batch
    # each step (or optimizer microbatch) feeds the model is split into this many pipeline microbatches;
    # the bubble is pipeline_parallel.bubble_fraction.
    pipeline_microbatches: int = 1
    # Circular (interleaved) pipeline: each stage holds this many chunks of layers, assigned round-robin,
    # and a microbatch goes round the stages this many times. n_layers must divide by pipeline * repeats.
    pipeline_repeats: int = 1

    def shape(self, num_devices: int) -> dict[str, int]:
        degrees = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor, "pipeline": self.pipeline}
        free = [k for k, v in degrees.items() if v == -1]
        if len(free) > 1:
            raise ConfigError(f"MeshConfig: only one axis may be -1, got {degrees}")
        bad = {k: v for k, v in degrees.items() if v == 0 or v < -1}
        if bad:
            raise ConfigError(f"MeshConfig: degrees must be positive (or one -1), got {bad}")
        fixed = math.prod(v for v in degrees.values() if v != -1)
        if free:
            if num_devices % fixed:
                raise ConfigError(
                    f"MeshConfig: {degrees} cannot fill {num_devices} devices "
                    f"({num_devices} is not divisible by {fixed})")
            degrees[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ConfigError(
                f"MeshConfig: data*fsdp*tensor*pipeline = {'*'.join(str(v) for v in degrees.values())} "
                f"= {fixed}, but {num_devices} devices are present")
        return degrees


@gin.configurable
@dataclasses.dataclass(frozen=True)
class OptimConfig:
    name: str = "adamw"  # adamw | adafactor | lion
    learning_rate: float = 3e-4
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    schedule: str = "cosine"  # cosine | linear | constant | wsd
    warmup_steps: int = 100
    decay_fraction: float = 0.2  # wsd: fraction of the steps spent decaying
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # global-norm clipping; 0 turns it off
    microbatches: int = 1  # gradient accumulation inside the jitted step
    loss_scale: float = 2.0**15  # initial dynamic loss scale (used only when dtype is float16)
    # Host offload (JAX memory kinds, maxlm.train.step): keep the optimizer state in pinned host
    # memory between steps; the step copies it to the device for the update and back. Device
    # memory falls by the optimizer state (AdamW: 8 bytes per parameter over the fsdp shards).
    offload_state: bool = False
    # ...and the parameters too (MaxText's parameter offload): the step copies them all to the
    # device at its start, so this frees device memory between steps, not at the step's peak.
    offload_params: bool = False


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The input pipeline (maxlm/data/README.md shows the whole flow from raw files to training)."""

    # One source, or several separated by ';' for a mixture. Each is "stdlib", "files:GLOB",
    # "jsonl:GLOB[:FIELD]", "parquet:GLOB[:COLUMN]" or "packed:DIR" (from `python -m maxlm.data
    # prepare`); a bare glob is read by its extension. See maxlm/data/spec.py.
    source: str = "stdlib"
    weights: str = ""  # mixture weights, one per source in order, e.g. "0.6, 0.2, 0.1, 0.1"; "" = equal
    tokenizer: str = "byte"  # "byte", or the path of a tokenizer.json from `maxlm.data train-tokenizer`
    seed: int = 0  # global shuffle of documents (raw sources) or packed rows
    eval_fraction: float = 0.02  # raw sources: documents held out for evaluation (by a hash of their id)
    worker_count: int = 0  # Grain worker processes; 0 reads in the training process
    prefetch: int = 2  # batches prepared ahead (per worker, or by one thread when worker_count = 0)
    max_doc_bytes: int = 33554432  # raw sources: longer documents are skipped and counted (32 MiB)
    read_threads: int = 8  # threads that read and tokenise raw documents (per worker)
    # Raw sources: packed rows are shuffled in windows of this many rows (0 or 1: off). A long
    # document packs into many consecutive rows; unshuffled, a batch is one file's run of rows.
    shuffle_rows: int = 1024
    # Logical data shards, each read by one process; 0 means one per process. Fix it (e.g. to the
    # most processes the job will use) and the global batch no longer depends on the process count.
    shards: int = 0


@gin.configurable
@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    enabled: bool = True
    every_steps: int = 100  # 0: by time only
    every_minutes: float = 0.0  # also save when this long has passed since the last save; 0: off
    max_to_keep: int = 3
    keep_every_steps: int = 0  # additionally keep every checkpoint whose step divides by this; 0: off
    async_save: bool = True  # write in the background while training continues
    verify_hashes: bool = True  # sha256 every written file into the manifest, check it on restore


@gin.configurable
@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    global_batch: int = 8  # sequences per optimizer step, over all devices and microbatches
    seq_len: int = 256
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 4
    log_every: int = 10
    z_loss: float = 0.0  # weight of log(Z)^2, PaLM's auxiliary loss
    peak_flops: float = 0.0  # per-device peak FLOP/s for MFU; 0 measures a matmul at start-up
    sample_tokens: int = 200  # length of the text sample printed at the end; 0 skips it
    run_dir: str = "runs/default"
    init_params: str = ""  # start from these parameters (e.g. from `maxlm.hf import`) instead of random
    # Warm start: a run directory (its newest good checkpoint) or RUN_DIR/checkpoints/STEP whose
    # parameters initialise a fresh run (step 0, new optimizer state), e.g. a pruned model.
    init_from: str = ""
    # Bad steps: a non-finite loss or gradient is always skipped. A spike above the rolling mean by
    # more than spike_sigmas standard deviations (of loss or grad norm) is skipped too; 0 turns it off.
    spike_sigmas: float = 0.0
    spike_window: int = 100  # steps in the rolling mean and variance
    spike_warmup: int = 50  # steps before spikes are judged
    rollback_after: int = 0  # after this many consecutive bad steps, restore the last checkpoint; 0: off
    rollback_lr_factor: float = 0.5  # and scale the learning rate by this from then on
    # Tasks evaluated with every eval (every eval_every steps and at the end), logged as
    # eval/<task>/<metric>: comma-separated task files or names, as `python -m maxlm.eval --task`
    # takes them (maxlm/eval/tasks.py), e.g. "perplexity:stdlib, data/mmlu_dev.jsonl". "" = none.
    eval_tasks: str = ""
    # What the run optimises (maxlm.train.tasks / maxlm.posttrain): "pretraining" on DataConfig's
    # sources, "sft" on SFTConfig's examples, or "distill" (DistillConfig: a teacher's logits on
    # DataConfig's sources), "dpo" (DPOConfig: preference pairs), "reward" (RewardConfig: a reward
    # model on preference pairs), "grpo" (GRPOConfig: RL from verifiable rewards). Each post-training task adds its name here and its
    # own config section, as SFTConfig does.
    task: str = "pretraining"
    # The live cost line (devices x price x elapsed, shown beside tokens/s and logged as cost_usd):
    # US$ per device-hour; 0 looks the device kind up in the planner's price table (maxlm.plan),
    # and an unknown kind (a CPU) shows no cost.
    price_per_device_hour: float = 0.0


@gin.configurable
@dataclasses.dataclass(frozen=True)
class DoctorConfig:
    """The run doctor's bounds (maxlm/train/doctor.py; README "Run doctor"). Windowed rules judge
    the last ``window`` logged windows (TrainConfig.log_every steps each); each rule fires once."""

    enabled: bool = True
    window: int = 20  # logged windows a trend rule looks at (200 steps at log_every = 10)
    flat_drop: float = 0.01  # train loss flat: it fell by less than this fraction over the window
    flat_lr_fraction: float = 0.25  # ... judged only while the lr is above this fraction of its peak
    oscillation: float = 0.02  # loss oscillating: its window-to-window variance (trend removed) over its mean
    rise: float = 0.2  # loss diverging: the recent median loss above the run's best median by this fraction
    overfit_rise: float = 0.02  # overfitting: eval loss above its best by this fraction while train falls by as much
    grad_norm_high: float = 20.0  # the median gradient norm over the window above this ...
    grad_norm_low: float = 0.1  # ... or below this
    nonfinite_steps: int = 1  # non-finite steps (skipped updates) before the rule fires
    # step time: the window's median above the run's early median by this fraction (and by three
    # robust standard deviations of the early times, so a shared host's noise is not a straggler)
    step_time_drift: float = 0.5
    memory_headroom: float = 0.1  # free device memory (backend memory stats; none on CPU) below this fraction
    data_wait: float = 0.2  # the share of the window's wall time spent waiting for batches above this


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig
    mesh: MeshConfig
    optim: OptimConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    train: TrainConfig
    sft: SFTConfig = SFTConfig()
    distill: DistillConfig = DistillConfig()
    dpo: DPOConfig = DPOConfig()
    reward: RewardConfig = RewardConfig()
    grpo: GRPOConfig = GRPOConfig()
    doctor: DoctorConfig = DoctorConfig()
    source: str = "<bindings>"  # the gin file it came from, for error messages

    def to_dict(self) -> dict[str, Any]:
        return {f.name: dataclasses.asdict(getattr(self, f.name))
                for f in dataclasses.fields(self) if f.name != "source"}

    def replace(self, **sections: Any) -> "Config":
        """Return a copy with fields of sections replaced: cfg.replace(train={'steps': 5})."""
        changes = {k: dataclasses.replace(getattr(self, k), **v) for k, v in sections.items()}
        return dataclasses.replace(self, **changes)


SECTIONS = {"model": ModelConfig, "mesh": MeshConfig, "optim": OptimConfig, "data": DataConfig,
            "checkpoint": CheckpointConfig, "train": TrainConfig, "sft": SFTConfig, "distill": DistillConfig,
            "dpo": DPOConfig, "reward": RewardConfig, "grpo": GRPOConfig, "doctor": DoctorConfig}
TASKS = ("pretraining", "sft", "distill", "dpo", "reward", "grpo")


def resolve_path(name: str) -> Path:
    """A path as given (a bucket's through the local cache), else a bare name looked up in
    configs/ (with or without .gin)."""
    from maxlm.storage import local_input

    path = Path(local_input(name))
    if path.is_file():
        return path
    for candidate in (CONFIG_DIR / name, CONFIG_DIR / f"{name}.gin"):
        if candidate.is_file():
            return candidate
    known = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.gin")))
    raise ConfigError(f"config file '{name}' not found (looked in . and {CONFIG_DIR}; known: {known})")


def _one_line(err: Exception) -> str:
    text = " ".join(str(err).split())
    # gin appends "In file ..., line N" context; keep it, drop the repeated source excerpt.
    return re.sub(r"\s*\^\s*$", "", text)


def load(config: str | None = None, bindings: list[str] | tuple[str, ...] = (),
         num_devices: int | None = None) -> Config:
    """Parse a gin file plus override bindings into a validated Config."""
    path = resolve_path(config) if config else None
    source = path.name if path else "<bindings>"
    gin.clear_config()
    logging.disable(logging.ERROR)  # gin also logs a missing include; the ConfigError says it once
    try:
        gin.parse_config_files_and_bindings([str(path)] if path else [], list(bindings),
                                            finalize_config=False)
        sections = {name: cls() for name, cls in SECTIONS.items()}
    except (ValueError, TypeError, SyntaxError, KeyError) as err:  # gin's parse and binding errors
        raise ConfigError(f"{source}: {_one_line(err)}") from None
    except ImportError as err:  # a gin `import` of a module that is not there
        raise ConfigError(f"{source}: a gin `import` failed: {_one_line(err)}") from None
    except OSError as err:  # a gin `include` of a file that is not there
        raise ConfigError(f"{source}: {_one_line(err)}") from None
    finally:
        logging.disable(logging.NOTSET)
        gin.clear_config()  # bindings are global in gin: never let them leak into a later Config
    cfg = Config(**sections, source=source)
    validate(cfg, num_devices)
    return cfg


def build(num_devices: int | None = None, **sections: dict[str, Any]) -> Config:
    """A validated Config from plain keyword dicts, for tests and notebooks (no gin involved)."""
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise ConfigError(f"unknown config sections {sorted(unknown)}; known: {sorted(SECTIONS)}")
    parts = {}
    for name, cls in SECTIONS.items():
        try:
            parts[name] = cls(**sections.get(name, {}))
        except TypeError as err:
            raise ConfigError(f"{cls.__name__}: {err}") from None
    cfg = Config(**parts)
    validate(cfg, num_devices)
    return cfg


def operative_gin(cfg: Config) -> str:
    """The config as a gin file that reproduces it exactly."""
    lines = [f"# operative config (from {cfg.source})"]
    for name, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            lines.append(f"{cls.__name__}.{field.name} = {getattr(getattr(cfg, name), field.name)!r}")
    return "\n".join(lines) + "\n"


def _choice(src: str, field: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{src}: {field} = {value!r} is not one of {', '.join(allowed)}")


_TYPES = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
          "tuple[tuple[str, str], ...]": (tuple,)}


def _check_types(cfg: Config) -> None:
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        for field in dataclasses.fields(cls):
            value, allowed = getattr(section, field.name), _TYPES[field.type]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise ConfigError(f"{cfg.source}: {cls.__name__}.{field.name} = {value!r} "
                                  f"should be of type {field.type}")


SEED_LIMIT = 2**32  # seeds become uint32 PRNG keys
# Every numeric field's allowed range: (low, high, what), checked before anything compiles. "what"
# is "positive" (> low), ">= 0" (>= low) or an interval "[low, high)" / "(low, high]" / "[low, high]".
RANGES: dict[str, tuple[float, float, str]] = {
    **{f"ModelConfig.{f}": (0, math.inf, "positive") for f in (
        "vocab_size", "vocab_multiple", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len", "norm_eps",
        "rope_theta", "rope_low_freq_factor", "rope_high_freq_factor", "rope_original_max_len", "init_std")},
    **{f"ModelConfig.{f}": (0, math.inf, ">= 0") for f in (
        "n_kv_heads", "head_dim", "rope_scaling_factor", "sliding_window", "int8_group", "lora_rank")},
    "ModelConfig.lora_alpha": (0, math.inf, "positive"),
    "ModelConfig.lora_dropout": (0, 1, "[low, high)"),
    "ModelConfig.quant_group": (0, math.inf, "positive"),
    **{f"MeshConfig.{f}": (0, math.inf, "positive") for f in ("pipeline_microbatches", "pipeline_repeats")},
    **{f"OptimConfig.{f}": (0, math.inf, "positive") for f in ("learning_rate", "microbatches")},
    **{f"OptimConfig.{f}": (0, math.inf, ">= 0") for f in ("warmup_steps", "eps", "weight_decay", "grad_clip")},
    "OptimConfig.min_lr_ratio": (0, 1, "[low, high]"), "OptimConfig.decay_fraction": (0, 1, "(low, high]"),
    "OptimConfig.b1": (0, 1, "[low, high)"), "OptimConfig.b2": (0, 1, "[low, high)"),
    "OptimConfig.loss_scale": (1, math.inf, "[low, high)"),
    "DataConfig.seed": (0, SEED_LIMIT, "[low, high)"), "DataConfig.eval_fraction": (0, 1, "[low, high)"),
    **{f"DataConfig.{f}": (0, math.inf, ">= 0") for f in ("worker_count", "prefetch", "shards", "shuffle_rows")},
    **{f"DataConfig.{f}": (0, math.inf, "positive") for f in ("max_doc_bytes", "read_threads")},
    **{f"CheckpointConfig.{f}": (0, math.inf, ">= 0") for f in ("every_steps", "every_minutes", "keep_every_steps")},
    "CheckpointConfig.max_to_keep": (0, math.inf, "positive"),
    **{f"TrainConfig.{f}": (0, math.inf, "positive") for f in (
        "steps", "global_batch", "seq_len", "eval_every", "eval_batches", "log_every")},
    **{f"TrainConfig.{f}": (0, math.inf, ">= 0") for f in (
        "z_loss", "peak_flops", "sample_tokens", "spike_sigmas", "spike_warmup", "rollback_after")},
    "TrainConfig.seed": (0, SEED_LIMIT, "[low, high)"), "TrainConfig.spike_window": (2, math.inf, "[low, high)"),
    "TrainConfig.rollback_lr_factor": (0, 1, "(low, high]"),
    "TrainConfig.price_per_device_hour": (0, math.inf, ">= 0"),
    **{f"DoctorConfig.{f}": (0, math.inf, "positive") for f in (
        "flat_drop", "oscillation", "rise", "overfit_rise", "grad_norm_high", "nonfinite_steps", "step_time_drift")},
    "DoctorConfig.window": (4, math.inf, "[low, high)"),  # a trend needs a few points
    "DoctorConfig.grad_norm_low": (0, math.inf, ">= 0"),
    **{f"DoctorConfig.{f}": (0, 1, "[low, high]") for f in ("flat_lr_fraction", "memory_headroom", "data_wait")},
    **POSTTRAIN_RANGES,
}


def _check_ranges(cfg: Config) -> None:
    """Each numeric field finite and in its range (``RANGES``), else one line naming it."""
    for name, cls in SECTIONS.items():
        for field in dataclasses.fields(cls):
            key, value = f"{cls.__name__}.{field.name}", getattr(getattr(cfg, name), field.name)
            if field.type not in ("int", "float"):
                continue
            if not math.isfinite(value):
                raise ConfigError(f"{cfg.source}: {key} = {value!r} must be a finite number")
            if key not in RANGES:
                continue
            low, high, what = RANGES[key]
            if what == "positive" and not value > low:
                raise ConfigError(f"{cfg.source}: {key} must be positive, got {value}")
            if what == ">= 0" and not value >= low:
                raise ConfigError(f"{cfg.source}: {key} must be >= 0, got {value}")
            inside = {"[low, high)": low <= value < high, "(low, high]": low < value <= high,
                      "[low, high]": low <= value <= high}.get(what, True)
            if not inside:
                num = lambda x: str(int(x)) if float(x).is_integer() else f"{x:g}"
                interval = what.replace("low", num(low)).replace("high", num(high))
                raise ConfigError(f"{cfg.source}: {key} = {value} must lie in {interval}")


def eval_task_problem(spec: str) -> str | None:
    """What is wrong with one evaluation task entry (``maxlm.eval --task`` or an item of
    TrainConfig.eval_tasks), judged without reading any file; None if nothing. A task file is
    told from a task name by a suffix or a directory (``./NAME``)."""
    if not spec:
        return "an empty entry"
    if spec == "perplexity":
        return None
    if spec.startswith("perplexity:"):
        source = spec.removeprefix("perplexity:").strip()
        if not source:
            return f"{spec!r} names no data source after 'perplexity:' (e.g. perplexity:stdlib)"
        if source.startswith("packed:"):
            return f"{spec!r}: packed rows have no documents to score; name the raw source instead"
        return None
    if re.fullmatch(r"[A-Za-z0-9_\-]+", spec):
        return (f"unknown task {spec!r}: give a task file (FILE.jsonl, a text file, ./NAME), "
                "'perplexity' or 'perplexity:SOURCE'")
    return None


def eval_task_name(spec: str) -> str:
    """The name a task's metrics are logged under (eval/<name>/<metric>)."""
    if spec == "perplexity":
        return "perplexity"
    if spec.startswith("perplexity:"):
        return "perplexity_" + re.sub(r"[^A-Za-z0-9]+", "_", spec.removeprefix("perplexity:")).strip("_")
    return re.sub(r"[^A-Za-z0-9_\-]+", "_", Path(spec).stem) or "task"


def eval_task_list(value: str) -> list[str]:
    """TrainConfig.eval_tasks (or one --task) as its comma-separated entries."""
    return [part.strip() for part in value.split(",") if part.strip()]


def _check_eval_tasks(src: str, value: str) -> None:
    """Each TrainConfig.eval_tasks entry well formed (task files are read when training starts)."""
    entries = eval_task_list(value)
    if value.strip() and not entries:
        raise ConfigError(f"{src}: TrainConfig.eval_tasks = {value!r} names no task")
    for entry in entries:
        problem = eval_task_problem(entry)
        if problem:
            raise ConfigError(f"{src}: TrainConfig.eval_tasks: {problem}")
    names = [eval_task_name(e) for e in entries]
    for entry, name in zip(entries, names):
        if names.count(name) > 1:
            raise ConfigError(f"{src}: TrainConfig.eval_tasks lists two tasks named {name!r} "
                              f"(e.g. {entry!r}); each needs its own name for its metrics")


def _check_linear_rules(src: str, rules: tuple) -> None:
    """Each ModelConfig.linear_rules entry a (regex, implementation) pair that compiles."""
    for i, rule in enumerate(rules):
        where = f"ModelConfig.linear_rules[{i}]"
        if not (isinstance(rule, tuple) and len(rule) == 2 and all(isinstance(x, str) for x in rule)):
            raise ConfigError(f"{src}: {where} = {rule!r} should be a (regex, implementation) pair of strings")
        try:
            re.compile(rule[0])
        except re.error as err:
            raise ConfigError(f"{src}: {where}: regex {rule[0]!r} does not compile ({err})") from None
        _choice(src, f"{where} implementation", rule[1], LINEAR_IMPLS)


def _check_lora(src: str, m: ModelConfig) -> None:
    """ModelConfig.lora_targets a non-empty regex that names at least one Linear that can carry
    adapters. Checked with lora_rank = 0 too, so a run that turns LoRA off for a comparison keeps
    a config that turns it back on."""
    if not m.lora_targets.strip():
        raise ConfigError(f"{src}: ModelConfig.lora_targets = {m.lora_targets!r} is empty: name the Linears "
                          "by regex, e.g. 'attn/(q|v)_proj$', or '.' for all of them")
    try:
        re.compile(m.lora_targets)
    except re.error as err:
        raise ConfigError(f"{src}: ModelConfig.lora_targets = {m.lora_targets!r} does not compile ({err})") from None
    if not dataclasses.replace(m, lora_rank=m.lora_rank or 1).lora_paths():
        tied = " (a tied LM head has no weight of its own)" if m.tie_embeddings else ""
        raise ConfigError(f"{src}: ModelConfig.lora_targets = {m.lora_targets!r} matches no Linear{tied}; "
                          f"the paths are {', '.join(m.linear_inputs())}")


def quant_problem(m: ModelConfig) -> str | None:
    """What keeps the quantized Linears (and embedding) of ``m`` from their format, or None: the
    INT4 group a positive multiple of 8 (8 values per int32), and each group dividing its input."""
    if m.quant_group % 8:
        return f"ModelConfig.quant_group = {m.quant_group} must be a positive multiple of 8"
    inputs = {path: (field, size) for path, (field, size, _) in m.linear_inputs().items()}
    if m.tie_embeddings:
        head = m.linear_impl("lm_head")
        if head in QUANT_IMPLS and head != m.embedding:
            return (f"ModelConfig.tie_embeddings: the LM head is the embedding table, so it is stored as "
                    f"ModelConfig.embedding = {m.embedding!r}, not {head!r} (from linear/linear_rules); "
                    "set ModelConfig.embedding")
        del inputs["lm_head"]
    if m.embedding in QUANT_IMPLS:
        inputs["embedding"] = ("ModelConfig.d_model", m.d_model)
    for path, (field, size) in inputs.items():
        impl = m.embedding if path == "embedding" else m.linear_impl(path)
        if impl not in QUANT_IMPLS:
            continue
        group = m.quant_group_of(impl, size)
        if size % group:
            name = "quant_group" if impl == "int4" else "int8_group"
            return (f"ModelConfig.{name} = {group} does not divide the input size of {path} ({impl}): "
                    f"{field} = {size}")
    return None


def quant_mesh_problem(m: ModelConfig, degrees: dict[str, int]) -> str | None:
    """An INT4 weight packs 8 inputs per int32, so its packed input axis (split as the Linear's
    first input axis) must divide by that axis' mesh degree too; None if every one does."""
    inputs = dict(m.linear_inputs())
    if m.tie_embeddings:
        del inputs["lm_head"]
    rows = [(path, field, size, name) for path, (field, size, name) in inputs.items()
            if m.linear_impl(path) == "int4"]
    if m.embedding == "int4":
        rows.append(("embedding", "ModelConfig.d_model", m.d_model, "embed"))
    for path, field, size, name in rows:
        axes = rules.mesh_axes(name)
        split = math.prod(degrees[a] for a in axes)
        if (size // 8) % split:
            return (f"{path} (int4) packs {field} = {size} inputs into {size // 8} int32 rows, which "
                    f"{'*'.join(f'MeshConfig.{a}' for a in axes)} = {split} does not divide")
    return None


def _check_task(cfg: Config) -> None:
    """TrainConfig.task known, and each post-training section complete for its task and unset
    otherwise (``maxlm.posttrain_config``; files are read when the run starts)."""
    _choice(cfg.source, "TrainConfig.task", cfg.train.task, TASKS)
    check_posttrain(cfg)


def validate(cfg: Config, num_devices: int | None = None) -> None:
    """Reject inconsistent settings before anything compiles; each failure is one line."""
    _check_types(cfg)
    src, m, t, o = cfg.source, cfg.model, cfg.train, cfg.optim
    _choice(src, "ModelConfig.norm", m.norm, ("rms", "layer"))
    _choice(src, "ModelConfig.activation", m.activation, ("swiglu", "gelu"))
    _choice(src, "ModelConfig.position", m.position, ("rope", "learned"))
    _choice(src, "ModelConfig.remat", m.remat, ("none", "full", "save_dots", "save_named"))
    _choice(src, "ModelConfig.attention_impl", m.attention_impl, ("xla", "cudnn", "pallas"))
    _choice(src, "ModelConfig.linear", m.linear, LINEAR_IMPLS)
    _choice(src, "ModelConfig.embedding", m.embedding, ("dense",) + QUANT_IMPLS)
    _check_linear_rules(src, m.linear_rules)
    for field in ("dtype", "param_dtype"):
        _choice(src, f"ModelConfig.{field}", getattr(m, field), ("float32", "bfloat16", "float16"))
    _choice(src, "OptimConfig.name", o.name, ("adamw", "adafactor", "lion"))
    _choice(src, "OptimConfig.schedule", o.schedule, ("cosine", "linear", "constant", "wsd"))
    _check_ranges(cfg)
    _check_task(cfg)
    if m.head_dim == 0 and m.d_model % m.n_heads:
        raise ConfigError(f"{src}: ModelConfig.d_model = {m.d_model} is not divisible by "
                          f"ModelConfig.n_heads = {m.n_heads} (set ModelConfig.head_dim explicitly)")
    if m.n_heads % m.kv_heads:
        raise ConfigError(f"{src}: ModelConfig.n_heads = {m.n_heads} is not divisible by "
                          f"ModelConfig.n_kv_heads = {m.kv_heads}")
    _check_lora(src, m)
    problem = quant_problem(m)
    if problem:
        raise ConfigError(f"{src}: {problem}")
    if m.position == "rope" and m.dim_per_head % 2:
        raise ConfigError(f"{src}: rope needs an even head dimension, got {m.dim_per_head}")
    if t.seq_len > m.max_seq_len:
        raise ConfigError(f"{src}: TrainConfig.seq_len = {t.seq_len} exceeds "
                          f"ModelConfig.max_seq_len = {m.max_seq_len}")
    ck = cfg.checkpoint
    if t.rollback_after and not ck.enabled:
        raise ConfigError(f"{src}: TrainConfig.rollback_after = {t.rollback_after} needs checkpoints, "
                          "but CheckpointConfig.enabled = False")
    if t.sample_tokens >= m.max_seq_len:
        raise ConfigError(f"{src}: TrainConfig.sample_tokens = {t.sample_tokens} must be below "
                          f"ModelConfig.max_seq_len = {m.max_seq_len} (0 skips the sample)")
    _check_eval_tasks(src, t.eval_tasks)
    if t.init_from and t.init_params:
        raise ConfigError(f"{src}: TrainConfig.init_from = {t.init_from!r} and TrainConfig.init_params = "
                          f"{t.init_params!r} both name the starting parameters; set one")
    if cfg.doctor.grad_norm_low >= cfg.doctor.grad_norm_high:
        raise ConfigError(f"{src}: DoctorConfig.grad_norm_low = {cfg.doctor.grad_norm_low} must be below "
                          f"DoctorConfig.grad_norm_high = {cfg.doctor.grad_norm_high}")
    if t.init_from != t.init_from.strip():
        raise ConfigError(f"{src}: TrainConfig.init_from = {t.init_from!r} has leading or trailing spaces")
    if num_devices is None:
        return
    import jax  # late import: the config module stays importable without initialising devices

    if m.attention_impl == "cudnn" and jax.default_backend() != "gpu":
        raise ConfigError(f"{src}: ModelConfig.attention_impl = 'cudnn' needs NVIDIA GPUs, but this "
                          f"run's devices are {jax.default_backend()}; use 'xla'")
    try:
        degrees = cfg.mesh.shape(num_devices)
    except ConfigError as err:
        raise ConfigError(f"{src}: {err}") from None
    problem = mesh_problem(cfg, degrees) or quant_mesh_problem(m, degrees)
    if problem:
        raise ConfigError(f"{src}: {problem}")
    if o.offload_state or o.offload_params:  # host offload needs a host memory kind on this backend
        from maxlm.hardware import host_memory_problem

        problem = host_memory_problem()
        if problem:
            which = " and ".join(f"OptimConfig.{f} = True" for f in ("offload_state", "offload_params")
                                 if getattr(o, f))
            raise ConfigError(f"{src}: {which} needs host memory, but {problem}; set it to False")
    if cfg.data.shards and (cfg.data.shards % jax.process_count() or t.global_batch % cfg.data.shards):
        raise ConfigError(f"{src}: DataConfig.shards = {cfg.data.shards} must be a multiple of the process "
                          f"count {jax.process_count()} and divide TrainConfig.global_batch = {t.global_batch}")
    if t.global_batch % jax.process_count():
        raise ConfigError(f"{src}: TrainConfig.global_batch = {t.global_batch} is not divisible "
                          f"by the process count {jax.process_count()}")


def mesh_problem(cfg: Config, degrees: dict[str, int]) -> str | None:
    """What keeps this config from running on a mesh of these degrees (one line), or None.

    Shared by validation and the planner. Which dimension must divide by which degree comes from
    ``maxlm.rules`` (the logical names of ``ModelConfig.logical_sizes``); the batch and the pipeline
    add their microbatch and repeat counts."""
    m, t, mesh = cfg.model, cfg.train, cfg.mesh
    pipe, micro = degrees["pipeline"], cfg.optim.microbatches
    if pipe > 1 and m.n_layers % (pipe * mesh.pipeline_repeats):
        return (f"ModelConfig.n_layers = {m.n_layers} is not divisible by MeshConfig.pipeline * "
                f"MeshConfig.pipeline_repeats = {pipe}*{mesh.pipeline_repeats} = {pipe * mesh.pipeline_repeats}")
    batch_axes = rules.mesh_axes("batch")
    split = math.prod(degrees[a] for a in batch_axes) * micro
    if t.global_batch % split:
        return (f"TrainConfig.global_batch = {t.global_batch} is not divisible by {'*'.join(batch_axes)}"
                f"*microbatches = {'*'.join(str(degrees[a]) for a in batch_axes)}*{micro} = {split}")
    if pipe > 1 and m.lora_rank and m.lora_dropout:
        return (f"ModelConfig.lora_dropout = {m.lora_dropout} is not supported with MeshConfig.pipeline = {pipe} "
                "(the pipeline runs its layers without dropout keys); set lora_dropout = 0 or pipeline = 1")
    rows = t.global_batch // split  # what one batch shard feeds the model per optimizer microbatch
    if pipe > 1 and rows % mesh.pipeline_microbatches:
        return (f"MeshConfig.pipeline_microbatches = {mesh.pipeline_microbatches} does not divide the rows "
                f"per data*fsdp shard and optimizer microbatch, TrainConfig.global_batch / (data*fsdp*"
                f"OptimConfig.microbatches) = {t.global_batch}/({degrees['data']}*{degrees['fsdp']}*"
                f"{micro}) = {rows}")
    return rules.divisibility_problem(m.logical_sizes(), degrees)
