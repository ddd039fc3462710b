"""What scripts/compare_drafts.py compares: one training job per draft of a view, each a recipe
TOML with the comparison's overrides, checked before any job starts (the trainer's own checks, and
the data and target that every draft must share)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import re
from collections.abc import Callable

from titan_draft.components.preflight import check_job_before_loading
from titan_draft.config import ConfigManager, validate_job_config
from titan_draft.config.manager import ConfigError
from titan_draft.features.target import check_target_config

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout

DEFAULT_CONFIGS = ",".join(f"train_configs/{d}_smollm2.toml" for d in ("eagle3", "dflash2", "dspark"))
# Keys the comparison sets itself: an override of one would change what is compared.
OWN_KEYS = {"job.config_file", "job.dump_folder", "training.steps", "training.epochs",
            "metrics.enable_tensorboard", "eval.enable", "checkpoint.export"}
# The data and target every draft must share.
SHARED_KEYS = (("target", "path"), ("data", "source"), ("data", "holdout_rows"))
# Equal drafted tokens per round, n: the model arg that sets it and its value. DSpark's block of b
# slots drafts b tokens, a DFlash2 block of b slots drafts b - 1 (its slot 0 holds the anchor),
# EAGLE-3 drafts one token per step of its chain, trained to that depth by ttt_steps.
ARG_FOR_DRAFTED = {"dspark": ("block_size", lambda n: n), "dflash2": ("block_size", lambda n: n + 1),
                   "eagle3": ("ttt_steps", lambda n: n)}


class CompareError(Exception):
    """One line for the user, with an exit status (2: the request is wrong, 1: a run failed)."""

    def __init__(self, line: str, status: int = 2):
        super().__init__(line)
        self.status = status


Arm = tuple[tuple[str, str], ...]
"""One ablation job's changes: ``((key, value), ...)``, one pair unless the keys change together."""

# '+' joins the keys of one change, where a dotted key follows it ("1e+3" stays a value)
_JOINT = re.compile(r"\+(?=[A-Za-z_][\w-]*\.[\w.-]+=)")


def _key_values(spec: str, part: str) -> tuple[str, list[str]]:
    key, sep, values = part.partition("=")
    key = key.strip().removeprefix("--")
    vals = [v.strip() for v in values.split(",")]
    if not sep or not key or "." not in key or not all(vals):
        raise CompareError(f"--ablate {spec!r}: expected KEY=V1[,V2...] with a dotted job-config key (or "
                           "KEY=V+KEY2=V2, changed together), e.g. model.args.markov_rank=64,512")
    if key in OWN_KEYS:
        raise CompareError(f"--ablate {key}: set by the comparison for every job")
    return key, vals


def parse_ablations(specs: list[str], view: str) -> list[Arm]:
    """One :data:`Arm` per ablation job: ``model.args.markov_rank=64,512`` gives two (one per value),
    ``model.args.ce_loss_weight=1.0+model.args.l1_loss_weight=0.0`` one that changes both keys (a
    loss weight moved from one term to another). Refused in one line where malformed, repeated, a
    key the comparison sets, or outside the ablation view."""
    if view != "ablation":
        if specs:
            raise CompareError(f"--ablate belongs to --view ablation, not {view}")
        return []
    if not specs:
        raise CompareError("--view ablation needs at least one --ablate KEY=V1[,V2...]")
    arms: list[Arm] = []
    single_keys: set[str] = set()
    for spec in specs:
        parts = [_key_values(spec, part) for part in _JOINT.split(spec)]
        if len(parts) == 1:
            key, vals = parts[0]
            if key in single_keys or len(set(vals)) < len(vals):
                raise CompareError(f"--ablate {spec!r}: a key or value given twice")
            single_keys.add(key)
            arms += [((key, v),) for v in vals]
            continue
        if any(len(vals) > 1 for _, vals in parts):
            raise CompareError(f"--ablate {spec!r}: each key of a joint change (KEY=V+KEY2=V2) takes one value")
        if len({k for k, _ in parts}) < len(parts):
            raise CompareError(f"--ablate {spec!r}: a key or value given twice")
        arms.append(tuple((k, vals[0]) for k, vals in parts))
    if len({tuple(sorted(arm)) for arm in arms}) < len(arms):
        raise CompareError("--ablate: the same change given twice")
    return arms


def parse_seeds(spec: str | None) -> list[int] | None:
    """``--training-seeds 42,43``: the training seeds of every draft (None: each recipe's own, one job)."""
    if spec is None:
        return None
    try:
        seeds = [int(s) for s in spec.split(",")]
    except ValueError:
        raise CompareError(f"--training-seeds {spec!r}: expected comma-separated integers, e.g. 42,43") from None
    if len(set(seeds)) < len(seeds) or any(s < 0 for s in seeds):
        raise CompareError(f"--training-seeds {spec!r}: each seed once, each >= 0")
    return seeds


def ablation_label(arm: Arm) -> str:
    """The run label suffix of one ablation job: each key without ``model.args.``, then its value."""
    return "+".join(f"{key.removeprefix('model.args.')}={value}" for key, value in arm)


def override_keys(overrides: list[str]) -> set[str]:
    """The config keys a ``--section.key value`` list sets (``--no-x.y`` and ``--x.y=v`` too)."""
    keys = set()
    for token in overrides:
        if token.startswith("--"):
            key = token[2:].split("=", 1)[0]
            key = key.removeprefix("no-")
            keys.add(key.replace("-", "_"))
    return keys


def own_args(dump: str, steps: int) -> list[str]:
    """The keys of OWN_KEYS (but the config file) as every job of the comparison gets them."""
    return ["--job.dump_folder", dump, "--training.steps", str(steps), "--metrics.enable_tensorboard", "true",
            "--eval.enable", "false", "--checkpoint.export", "true"]


def _abspath_if_exists(path: str | None) -> str | None:
    return os.path.abspath(path) if path and os.path.exists(path) else path


def build_runs(a, extra: list[str], log: Callable[[str], None] = print, check: bool = True) -> list[dict]:
    """One entry per training job of the view (per ``a.training_seeds`` seed where given): label,
    group (the view's draft, shared by its seeds), seed, config path, its argv without the keys the
    comparison sets, the resolved job config. ``check``: run the trainer's checks of each job
    (off for a report from records, whose target and data may be on another machine)."""
    if extra and not extra[0].startswith("--"):
        raise CompareError(f"unexpected argument {extra[0]!r} (overrides are --section.key value)")
    own = sorted(override_keys(extra) & OWN_KEYS)
    if own:
        raise CompareError(f"--{own[0]} is set by the comparison for every job, not by an override")
    seeds = a.training_seeds or [None]
    if a.training_seeds:
        if "training.seed" in override_keys(extra):
            raise CompareError("--training.seed is set by --training-seeds for every job, not by an override")
        if any(key == "training.seed" for arm in a.ablate for key, _ in arm):
            raise CompareError("--ablate training.seed: with --training-seeds every job is trained once per seed")
    shared = []
    if a.target:
        shared += ["--target.path", _abspath_if_exists(a.target)]
    if a.data:
        shared += ["--data.source", _abspath_if_exists(a.data)]
    runs = []
    for path in a.configs.split(","):
        config = os.path.abspath(path)
        stem = os.path.splitext(os.path.basename(config))[0]
        base = ["--job.config_file", config]
        cfg = _resolve(base + shared + extra)
        variants = [(stem, [])]
        if a.view == "ablation":
            clash = sorted(override_keys(extra) & {k for arm in a.ablate for k, _ in arm})
            if clash:
                raise CompareError(f"--{clash[0]} is both an override for every draft and an --ablate key")
            variants += [(f"{stem}+{ablation_label(arm)}", [x for k, v in arm for x in (f"--{k}", v)])
                         for arm in a.ablate]
        elif a.view == "equal-draft-tokens":
            if cfg.model.name not in ARG_FOR_DRAFTED:
                log(f"{stem}: left out of the equal-draft-tokens view (no setting of draft {cfg.model.name!r} "
                    "is known to set its drafted tokens)")
                continue
            arg, rule = ARG_FOR_DRAFTED[cfg.model.name]
            if f"model.args.{arg}" in override_keys(extra):
                raise CompareError(f"--model.args.{arg} is set by the equal-draft-tokens view (see --drafted)")
            variants = [(f"{stem}-drafted{n}", [f"--model.args.{arg}", str(rule(n))]) for n in a.drafted]
        for (label, view_args), seed in itertools.product(variants, seeds):
            seed_args = [] if seed is None else ["--training.seed", str(seed)]
            argv = base + view_args + seed_args + shared + extra
            # a group: one draft of the view, trained once per seed (the same steps, one calibration)
            runs.append({"label": label if seed is None else f"{label}-seed{seed}", "group": label, "seed": seed,
                         "config": config, "view_args": view_args, "argv": argv,
                         "cfg": _resolve(argv + own_args("unused", 1))})
    if not runs:
        raise CompareError(f"no draft of {a.configs} takes part in the {a.view} view")
    labels = [r["label"] for r in runs]
    if len(set(labels)) < len(labels):
        raise CompareError(f"--configs: two configs have the same file name ({labels}): each draft's folder is named "
                           "after its config")
    for section, key in SHARED_KEYS:
        values = {r["label"]: getattr(getattr(r["cfg"], section), key) for r in runs}
        if len(set(map(str, values.values()))) > 1:
            raise CompareError(f"{section}.{key} differs between the drafts ({values}): the comparison trains "
                               f"every draft on the same data for the same target (--target, --data)")
    if check:
        for run in runs:
            check_job(run)
    return runs


@contextlib.contextmanager
def _in_repo():
    """Relative paths of a recipe are the repository's, as its jobs (run from there) read them."""
    old = os.getcwd()
    os.chdir(REPO)
    try:
        yield
    finally:
        os.chdir(old)


def check_job(run: dict) -> None:
    """The trainer's own checks that need no weights (values, draft args, target folder, data
    rows), for every draft before the first job spends any time."""
    quiet = logging.getLogger("compare_drafts.checks")
    quiet.setLevel(logging.ERROR)  # the job itself logs its warnings
    with _in_repo():
        try:
            validate_job_config(run["cfg"], quiet)
            check_target_config(run["cfg"])
            check_job_before_loading(run["cfg"])
        except ValueError as e:
            raise CompareError(f"{run['label']}: {e}") from None


def _resolve(argv: list[str]):
    try:
        cfg = ConfigManager().parse_args(argv)
    except ConfigError as e:
        raise CompareError(str(e)) from None
    if cfg.training.epochs > 0:
        raise CompareError(f"{argv[1]}: training.epochs = {cfg.training.epochs}: the comparison chooses "
                           "training.steps from the budget; set epochs to 0")
    return cfg
