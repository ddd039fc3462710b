"""Compare drafts fairly: the same wall-clock budget per training job, the same data and prompts.

    python scripts/compare_drafts.py --minutes 6 --speed-dtype bfloat16
    python scripts/compare_drafts.py --minutes 6 --view equal-draft-tokens
    python scripts/compare_drafts.py --minutes 6 --view ablation --configs train_configs/dspark_smollm2.toml \
        --ablate model.args.markov_rank=64,512 --ablate optimizer.lr=3e-4

For each draft (a recipe TOML; default the three SmolLM2 recipes):

1. calibration: the draft's own job for ``--calibration-steps`` steps, timed from start to exit;
   its median warm step and what the job spent besides its steps (start-up, target load, compile,
   warm-up, the last checkpoint, the export) are recorded;
2. plan: the training steps whose whole job fits ``--minutes`` (less ``--margin`` of it); the
   recipe's lr schedule (warm-up ratio, cosine) then spans those steps;
3. training: the real job, timed from start to exit; its steps, median logged step, peak memory;
4. eval: ``python -m titan_draft.eval`` on the export, fp32, at every ``--temperatures`` value (T = 0
   greedy with the token-for-token lossless check, T > 0 speculative sampling with a fixed seed),
   and with ``--speed-dtype`` greedy in that dtype for speculative against plain tokens/s. The
   target's plain greedy decodes are the same for every draft: the first T = 0 eval of a dtype
   makes them (and times them) into ``<out>/greedy_<dtype>.json``, the later ones check against
   them (``titan_draft.eval --greedy-cache``; another machine or boot decodes them anew).

The table goes to ``<out>/table_<view>.md`` and ``.json``. Every stage writes its result to
``<out>/<draft>/``; run the same command again after an interruption and finished stages are
skipped, an interrupted training resumes from its last checkpoint. In-training evals are off in
every job (the budget is for training; the eval above measures every draft the same way).
Arguments the script does not know are job-config overrides for every draft
(``--data.packing true``). docs/compare.md has more.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import shutil
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # runnable from a checkout without an install
    sys.path.insert(0, REPO)

from scripts.compare.plan import (
    BudgetError,
    Calibration,
    build_calibration,
    calibration_save_step,
    choose_steps,
    read_run_metrics,
    summarize_run,
)
from scripts.compare.report import (
    build_row,
    eval_report_name,
    speed_source,
    write_table,
)
from scripts.compare.jobs import (
    LOG_PATH,
    Interrupted,
    changed_settings,
    last_line,
    log_line,
    portable_record,
    read_json,
    run_logged,
    settings_changes,
    write_json,
)
from scripts.compare.runs import DEFAULT_CONFIGS, CompareError, build_runs, own_args, parse_ablations, parse_seeds
from titan_draft.checkpoint.export import exported_step


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog="python scripts/compare_drafts.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated recipe TOMLs, one per draft")
    p.add_argument("--minutes", type=float, required=True, help="wall-clock budget of each training job")
    p.add_argument("--margin", type=float, default=0.03, help="share of the budget kept free (a slower step, a save)")
    p.add_argument("--target", default=None, help="target HF folder for every draft (default: the configs' target.path)")
    p.add_argument("--data", default=None, help="data.source for every draft (default: the configs')")
    p.add_argument("--prompts", default="mtbench", help="eval prompts, as titan_draft.eval reads them")
    p.add_argument("--num-prompts", type=int, default=0, help="per prompt source (0: all; MT-Bench has 80)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,1", help="comma-separated eval temperatures (fp32)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed of the T > 0 evals")
    p.add_argument("--speed-dtype", default=None, choices=["bfloat16"],
                   help="also decode greedily in this dtype for speculative against plain tokens/s")
    p.add_argument("--device", default="auto", help="eval device: auto, cpu, cuda")
    p.add_argument("--view", default="recipes", choices=["recipes", "equal-draft-tokens", "ablation"],
                   help="recipes: each config as it is; equal-draft-tokens: every draft at equal drafted "
                        "tokens per round (--drafted; blocks sized, EAGLE-3's TTT unrolled to match); "
                        "ablation: each config as it is and once per "
                        "--ablate value, one change at a time")
    p.add_argument("--ablate", action="append", default=[], metavar="KEY=V1[,V2...]",
                   help="a job-config key and the values the ablation view tries (repeatable), e.g. "
                        "model.args.markov_rank=64,512 or data.packing=true; KEY=V+KEY2=V2 is one job "
                        "that changes both keys, e.g. model.args.ce_loss_weight=1.0+model.args.l1_loss_weight=0")
    p.add_argument("--training-seeds", default=None, metavar="S1,S2[,...]",
                   help="train each draft of the view once per training.seed (the same steps, one calibration); "
                        "the table then orders two drafts only where every pairing of their seeds is established")
    p.add_argument("--drafted", default="7,15", help="drafted tokens per round of the equal-draft-tokens view")
    p.add_argument("--calibration-steps", type=int, default=60)
    p.add_argument("--calibration-warmup", type=int, default=10, help="leading calibration steps left out of the median")
    p.add_argument("--launcher", default="run_train", choices=["run_train", "python"],
                   help="run_train: ./run_train.sh (torchrun, NGPU=1 unless set); python: python -m titan_draft.train")
    p.add_argument("--out", default="outputs/compare_drafts")
    p.add_argument("--report-only", action="store_true",
                   help="write the table from the records under --out and run nothing; a stage not done "
                        "leaves its cells empty (e.g. drafts compared one per machine, their folders gathered)")
    a, extra = p.parse_known_args(argv)
    if a.calibration_warmup < 0 or a.calibration_steps <= a.calibration_warmup:
        raise CompareError(f"--calibration-steps ({a.calibration_steps}) must exceed --calibration-warmup "
                           f"({a.calibration_warmup}) >= 0")
    try:
        a.temperatures = [float(t) for t in a.temperatures.split(",")]
        a.drafted = [int(n) for n in a.drafted.split(",")]
    except ValueError as e:
        raise CompareError(f"--temperatures / --drafted: {e}") from None
    a.ablate = parse_ablations(a.ablate, a.view)
    a.training_seeds = parse_seeds(a.training_seeds)
    if any(t < 0 for t in a.temperatures) or any(n < 1 for n in a.drafted):
        raise CompareError("--temperatures must be >= 0 and --drafted >= 1")
    return a, extra


def train_command(a, argv: list[str], dump: str, steps: int, extra: list[str]) -> tuple[list[str], dict]:
    """The job's command and environment. Each job compiles into a cache of its own (``<dump>.compile``):
    with a shared one the real job would find the calibration's kernels, start warm and end
    early by the compile time the plan paid for it."""
    job = [*argv, *own_args(dump, steps), *extra]
    cache = dump + ".compile"
    env = {"TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"), "TRITON_CACHE_DIR": os.path.join(cache, "triton")}
    if a.launcher == "python":
        return [sys.executable, "-m", "titan_draft.train", *job], env
    return [os.path.join(REPO, "run_train.sh"), *job], {**env, "NGPU": os.environ.get("NGPU", "1")}


def wanted_reports(a) -> list[tuple[float, str]]:
    """The (temperature, dtype) evals of the comparison: fp32 at each temperature, and the speed run."""
    wanted = [(t, "float32") for t in a.temperatures]
    speed = speed_source(a.temperatures, a.speed_dtype)
    return wanted + [speed] if speed is not None and speed not in wanted else wanted


# ---- the stages of one draft ----


def calibrate(a, run: dict, folder: str) -> dict:
    path = os.path.join(folder, "calibration.json")
    if (done := read_json(path)) is not None:
        log_line(f"{run['label']}: calibration already done ({path})")
        return done
    dump = os.path.join(folder, "calibration")
    for old in (dump, dump + ".compile"):  # always a fresh job: a resumed or warm one would time differently
        shutil.rmtree(old, ignore_errors=True)
    log = os.path.join(folder, "calibration.log")
    log_line(f"{run['label']}: calibration, {a.calibration_steps} steps (log {log})")
    save_step = calibration_save_step(a.calibration_steps, a.calibration_warmup) if run["cfg"].checkpoint.enable else None
    extra = ["--metrics.log_freq", "1"] + ([] if save_step is None else ["--checkpoint.interval", str(save_step)])
    cmd, env = train_command(a, run["argv"], dump, a.calibration_steps, extra)
    rc, wall = run_logged(cmd, log, env)
    if rc != 0 or exported_step(os.path.join(dump, run["cfg"].checkpoint.export_folder)) != a.calibration_steps:
        raise CompareError(f"{run['label']}: the calibration job failed (exit {rc}; {log}): {last_line(log)}", 1)
    try:
        metrics = read_run_metrics(os.path.join(dump, run["cfg"].metrics.save_tb_folder, "run"))
        calibration = build_calibration(metrics, a.calibration_steps, a.calibration_warmup, wall,
                                        save_step).to_json()
    except BudgetError as e:
        raise CompareError(f"{run['label']}: calibration: {e}", 1) from None
    write_json(path, calibration)
    log_line(f"{run['label']}: calibration {wall:.1f} s, median step {1e3 * calibration['median_step_s']:.1f} ms, "
             f"setup {calibration['setup_s']:.1f} s, a checkpoint save {calibration['save_s']:.2f} s")
    return calibration


def plan(a, run: dict, folder: str, calibration: dict) -> int:
    """The steps of the budget. Another budget than the one a started training was planned for is
    refused: its steps and lr schedule are those of the first."""
    ckpt = run["cfg"].checkpoint
    interval = ckpt.interval if ckpt.enable else 0
    cal = Calibration.from_json(calibration)
    steps = choose_steps(run["label"], 60 * a.minutes, cal, a.margin, interval)
    path = os.path.join(folder, "plan.json")
    old = read_json(path)
    new = {"budget_s": 60 * a.minutes, "margin": a.margin, "steps": steps, "save_interval": interval,
           "predicted_job_s": cal.job_s(steps, interval), "calibration": calibration}
    if old is not None and old != new and os.path.isdir(os.path.join(folder, "run")):
        raise CompareError(f"{run['label']}: {folder}/run was started for {old['budget_s'] / 60:g} min with margin "
                           f"{old['margin']:g} ({old['steps']} steps), not {a.minutes:g} min with margin {a.margin:g}: "
                           f"give another --out, or delete {folder}/run and {folder}/train.json to train again")
    write_json(path, new)
    return steps


def train(a, run: dict, folder: str, steps: int) -> None:
    dump = os.path.join(folder, "run")
    export = os.path.join(dump, run["cfg"].checkpoint.export_folder)
    record = os.path.join(folder, "train.json")
    if read_json(record) is not None and exported_step(export) == steps:
        log_line(f"{run['label']}: training already done ({record})")
        return
    attempts_path = os.path.join(folder, "train_attempts.json")
    attempts = (read_json(attempts_path) or {}).get("wall_s", [])
    if not os.path.isdir(os.path.join(dump, run["cfg"].checkpoint.folder)):
        attempts = []  # nothing to resume from: this job starts over, and so does its wall clock
    log = os.path.join(folder, "train.log")
    if exported_step(export) == steps and attempts:
        log_line(f"{run['label']}: the training job had finished ({export}); reading its record")
    else:
        log_line(f"{run['label']}: training, {steps} steps" + (f", attempt {len(attempts) + 1}" if attempts else "")
                 + f" (log {log})")
        cmd, env = train_command(a, run["argv"], dump, steps, [])
        try:
            rc, wall = run_logged(cmd, log, env)
        except Interrupted as e:  # its time counts: the resumed job goes on from its checkpoint
            write_json(attempts_path, {"wall_s": [*attempts, e.wall_s]})
            raise
        attempts.append(wall)
        write_json(attempts_path, {"wall_s": attempts})
        if rc != 0:
            raise CompareError(f"{run['label']}: the training job failed (exit {rc}; {log}): {last_line(log)}", 1)
        if exported_step(export) != steps:
            raise CompareError(f"{run['label']}: the training job stopped before step {steps} ({log}: "
                               f"{last_line(log)}); run the same command again to resume", 1)
    try:
        metrics = read_run_metrics(os.path.join(dump, run["cfg"].metrics.save_tb_folder, "run"))
        summary = summarize_run(metrics, steps, sum(attempts), len(attempts))
    except BudgetError as e:
        raise CompareError(f"{run['label']}: training: {e}", 1) from None
    for name in os.listdir(folder):  # a new training makes the reports of an earlier one stale
        if name.startswith("eval_t") and name.endswith(".json"):
            os.remove(os.path.join(folder, name))
    write_json(record, summary)
    log_line(f"{run['label']}: trained {steps} steps in {summary['wall_s'] / 60:.2f} min "
             f"(budget {a.minutes:g}), median step {summary['median_step_ms']:.1f} ms")


def evaluate(a, run: dict, folder: str) -> None:
    settings = {"target": run["cfg"].target.path, "prompts": a.prompts, "num_prompts": a.num_prompts,
                "max_new_tokens": a.max_new_tokens, "seed": a.seed, "device": a.device}
    changed = changed_settings(os.path.join(folder, "eval_settings.json"), settings)
    if changed:
        for name in os.listdir(folder):
            if name.startswith("eval_t") and name.endswith(".json"):
                os.remove(os.path.join(folder, name))
        log_line(f"{run['label']}: its eval reports were made with another {', '.join(changed)}: evaluating again")
        write_json(os.path.join(folder, "eval_settings.json"), portable_record(settings))
    export = os.path.join(folder, "run", run["cfg"].checkpoint.export_folder)
    for temperature, dtype in wanted_reports(a):
        out = os.path.join(folder, eval_report_name(temperature, dtype))
        if os.path.isfile(out):
            log_line(f"{run['label']}: eval T={temperature:g} {dtype} already done ({out})")
            continue
        log = os.path.join(folder, "eval.log")
        log_line(f"{run['label']}: eval T={temperature:g} {dtype} (log {log})")
        cmd = [sys.executable, "-m", "titan_draft.eval", "--target", settings["target"], "--draft", export,
               "--prompts", a.prompts, "--num-prompts", str(a.num_prompts), "--max-new-tokens",
               str(a.max_new_tokens), "--dtype", dtype, "--temperature", f"{temperature:g}", "--seed",
               str(a.seed), "--device", a.device, "--out", out]
        if temperature > 0:  # sampling: the plain decode checks nothing token for token
            cmd.append("--no-lossless-check")
        else:  # every draft is checked against the same plain greedy decodes: made once, by the first eval
            cmd += ["--greedy-cache", os.path.join(a.out, f"greedy_{dtype}.json")]
        rc, _ = run_logged(cmd, log)
        if rc != 0 or not os.path.isfile(out):
            raise CompareError(f"{run['label']}: the eval failed (exit {rc}; {log}): {last_line(log)}", 1)


def check_records(a, run: dict, folder: str, settings: dict) -> None:
    """--report-only: refuse records of another comparison, log the stages that have none."""
    recorded = read_json(os.path.join(folder, "settings.json"))
    if recorded is not None and (changed := ", ".join(settings_changes(recorded, settings))):
        raise CompareError(f"{folder} holds a comparison made with another {changed}: the table would mix two comparisons")
    plan_record = read_json(os.path.join(folder, "plan.json"))
    if plan_record is not None and (plan_record["budget_s"], plan_record["margin"]) != (60 * a.minutes, a.margin):
        raise CompareError(f"{folder} was planned for {plan_record['budget_s'] / 60:g} min with margin "
                           f"{plan_record['margin']:g}, not {a.minutes:g} min with margin {a.margin:g}")
    wanted = ["train.json", *(eval_report_name(*r) for r in wanted_reports(a))]
    missing = [name for name in wanted if not os.path.isfile(os.path.join(folder, name))]
    if missing:
        log_line(f"{run['label']}: no {', '.join(missing)} in {folder}: those cells stay empty")


def main(argv: list[str] | None = None) -> int:
    try:
        a, extra = parse_args(sys.argv[1:] if argv is None else argv)
        out = os.path.abspath(a.out)
        os.makedirs(out, exist_ok=True)
        LOG_PATH[:] = [os.path.join(out, "compare.log")]
        log_line(f"compare: {shlex.join(sys.argv if argv is None else ['compare_drafts.py', *argv])}")
        runs = build_runs(a, extra, log_line, check=not a.report_only)
        meta = {"view": a.view, "minutes": a.minutes, "margin": a.margin, "calibration_steps": a.calibration_steps,
                "prompts": a.prompts if not a.num_prompts else f"{a.prompts} (first {a.num_prompts})",
                "max_new_tokens": a.max_new_tokens, "temperatures": a.temperatures, "seed": a.seed,
                "speed_dtype": a.speed_dtype, "training_seeds": a.training_seeds, "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d}",
                "overrides": extra, "command": shlex.join(["python", "scripts/compare_drafts.py", *(
                    sys.argv[1:] if argv is None else argv)])}
        rows, calibrated_by = [], {}
        for run in runs:
            folder = os.path.join(out, run["label"])
            cal_run = calibrated_by.setdefault(run["group"], run)  # a draft's seeds train the same steps
            settings = {"argv": run["argv"], "launcher": a.launcher, "calibration_steps": a.calibration_steps,
                        "calibration_warmup": a.calibration_warmup}
            if a.report_only:
                check_records(a, run, folder, settings)
            else:
                os.makedirs(folder, exist_ok=True)
                changed = changed_settings(os.path.join(folder, "settings.json"), settings)
                if changed:
                    raise CompareError(f"{folder} holds a comparison made with another {', '.join(changed)}: give "
                                       "another --out, or delete that folder to start it again")
                calibration = calibrate(a, cal_run, os.path.join(out, cal_run["label"]))
                steps = plan(a, run, folder, calibration)
                train(a, run, folder, steps)
                evaluate(a, run, folder)
            info = {"draft": run["cfg"].model.name, "config": os.path.relpath(run["config"], REPO),
                    "view_overrides": run["view_args"], "budget_min": a.minutes, "group": run["group"],
                    "training_seed": run["seed"]}
            rows.append(build_row(folder, run["label"], info, a.temperatures, a.speed_dtype))
            md, js = write_table(out, rows, meta)
        log_line(f"compare: done. Table: {md} ({js})")
        return 0
    except (CompareError, BudgetError) as e:
        print(f"compare_drafts: error: {e}", file=sys.stderr)
        return getattr(e, "status", 2)


if __name__ == "__main__":
    sys.exit(main())
