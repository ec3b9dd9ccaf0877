"""Learning commands (TOP §V): ``train-gpg`` (the GPG stage partitioner behind scheduler ``top-gpg``) and
``train-policy`` (the MADDPG agents behind serving policy ``top``). Both train in simulation on the CPU
(:mod:`opweave.learn` does the training and writes the weights), show a rich progress bar and write the learning
curve (JSON beside the weights, and a PNG with ``--plot``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Annotated

import typer

from opweave.cli.app import app, err, guard
from opweave.errors import UsageError

ModelsOpt = Annotated[str, typer.Option("--models", metavar="MODEL,...", help="zoo models")]
SeedOpt = Annotated[int, typer.Option("--seed", help="random seed of the training")]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="learning curve PNG")]


def _bar():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TextColumn("{task.fields[info]}"), console=err)


def _curve_png(path: Path, series: dict[str, tuple[list[float], list[float]]], title: str, ylabel: str,
               xlabel: str = "episode") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for label, (x, y) in series.items():
        ax.plot(x, y, label=label, linewidth=1.2)
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@app.command("train-gpg")
@guard
def train_gpg(output: Annotated[Path, typer.Option("--output", "-o", help="weights file to write")],
              episodes: Annotated[int, typer.Option("--episodes", min=1, help="training graphs")] = 20000,
              models: ModelsOpt = "inception_v3,resnet50,squeezenet",
              preset: Annotated[str, typer.Option("--preset", "--device-preset", help="roofline preset")] = "h100",
              samples: Annotated[int, typer.Option("--samples", min=1, help="rollouts per chunk and graph")] = 4,
              lr: Annotated[float, typer.Option("--lr", min=0.0, help="Adam's first learning rate (falls "
                                                "linearly to a tenth over the run)")] = 1e-3,
              validate_every: Annotated[int, typer.Option("--validate-every", min=1, help="episodes between "
                                                          "validations (the best weights are kept)")] = 250,
              seed: SeedOpt = 0, plot: PlotOpt = None):
    """Train the GPG stage partitioner (TOP §V-C) by REINFORCE with a greedy-rollout baseline on random combinations
    of 1-6 zoo blocks and random DAGs; every ``--validate-every`` episodes its greedy makespan on 30 fixed combined
    blocks is compared with IOS's DP, and the weights that did best there are saved."""
    from opweave.learn import gpg

    start = time.perf_counter()
    source = gpg.GpgGraphs.from_zoo([m.strip() for m in models.split(",") if m.strip()], preset=preset, seed=seed)
    with _bar() as bar:
        task = bar.add_task("train-gpg", total=episodes, info="validating the untrained network")
        last: dict[str, float] = {}

        def on_episode(i: int, rec: dict) -> None:
            if "valid_over_dp" in rec:
                last["valid"] = rec["valid_over_dp"]
            bar.update(task, advance=1, info=f"sampled/greedy {rec['sampled_over_greedy']:.3f}"
                       + (f"  greedy/DP (validation) {last['valid']:.4f}" if "valid" in last else ""))

        kept = gpg.train_best(source, episodes, samples=samples, lr=lr, validate_every=validate_every, seed=seed,
                              on_episode=on_episode)
    elapsed = time.perf_counter() - start
    meta = {"command": f"opweave train-gpg --episodes {episodes} --seed {seed} --models {models} "
                       f"--preset {preset} --samples {samples} --lr {lr:g} --validate-every {validate_every}",
            "train_s": round(elapsed, 1), "kept_episode": kept.episode, "valid_over_dp": round(kept.valid_over_dp, 4),
            "rules_valid_over_dp": {k: round(v, 4) for k, v in kept.rules_over_dp.items()}}
    gpg.save(kept.net, output, meta)
    curve = kept.curve
    curve_path = (plot or output).with_suffix(".json")
    curve_path.write_text(json.dumps({"meta": meta, "curve": curve}, indent=1) + "\n")
    if plot:
        points = [(r["episode"], r["valid_over_dp"]) for r in curve if "valid_over_dp" in r]
        window = 200
        steps = [r for r in curve if "sampled_over_greedy" in r]
        smooth = [sum(r["sampled_over_greedy"] for r in steps[max(0, i - window + 1):i + 1]) / min(window, i + 1)
                  for i in range(len(steps))]
        series = {"greedy / IOS-DP (validation)": ([x for x, _ in points], [y for _, y in points]),
                  f"sampled / greedy (mean of last {window})": ([r["episode"] for r in steps], smooth)}
        for rule, ratio in kept.rules_over_dp.items():
            series[f"rule '{rule}' / IOS-DP (validation)"] = ([points[0][0], points[-1][0]], [ratio, ratio])
        _curve_png(plot, series, "GPG training", "makespan ratio")
    rules = ", ".join(f"{k} {v:.4f}" for k, v in kept.rules_over_dp.items())
    err.print(f"wrote {output} and {curve_path} in {elapsed:.0f} s; kept episode {kept.episode}: validation "
              f"greedy/DP {kept.valid_over_dp:.4f} (rules: {rules})")


@app.command("train-policy")
@guard
def train_policy(pattern: Annotated[str, typer.Option("--pattern", metavar="MODEL:RATE,...", help="each model's "
                                                                "requests per second")],
                 output: Annotated[Path, typer.Option("--output", "-o", help="policy file to write")],
                 steps: Annotated[int, typer.Option("--steps", min=0, help="decisions (MADDPG steps)")] = 8000,
                 period_ms: Annotated[float, typer.Option("--period-ms", min=0.1, help="virtual time per step")
                                      ] = 50.0,
                 episode_steps: Annotated[int, typer.Option("--episode-steps", min=1, help="steps per episode (each "
                                                            "from empty queues)")] = 40,
                 scales: Annotated[str, typer.Option("--scales", help="pattern scales drawn per episode")
                                   ] = "1,2,4,8,16,32",
                 warmup: Annotated[int, typer.Option("--warmup", min=1, help="transitions before the first update "
                                                     "(Alg. 1's replay_size)")] = 2000,
                 eval_every: Annotated[int, typer.Option("--eval-every", min=1, help="steps between held-out "
                                                         "evaluations (the best is kept)")] = 100,
                 eval_seeds: Annotated[str, typer.Option("--eval-seeds", help="held-out arrival traces")
                                       ] = "101,102",
                 eval_s: Annotated[float, typer.Option("--eval-s", min=0.01, help="virtual seconds per held-out "
                                                       "run")] = 1.0,
                 eval_max_scale: Annotated[float, typer.Option("--eval-max-scale", min=1.0, help="highest scale "
                                                               "of the pattern tried on held-out traces")] = 128.0,
                 slo_ms: Annotated[float, typer.Option("--slo-ms", min=0.1, help="held-out p99 bound")] = 100.0,
                 preset: Annotated[str, typer.Option("--preset", "--device-preset", help="roofline preset")] = "h100",
                 max_batch: Annotated[int, typer.Option("--max-batch", min=1, help="samples stacked in one "
                                                        "instance")] = 16,
                 max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="requests waiting per model "
                                                        "(then refused)")] = 64,
                 max_sub_blocks: Annotated[int, typer.Option("--max-sub-blocks", min=1, help="H")] = 4,
                 image_size: Annotated[str | None, typer.Option("--image-size", metavar="N[,MODEL=N...]",
                                                                      help="input size of zoo CNNs")
                                       ] = None,
                 seed: SeedOpt = 0, plot: PlotOpt = None):
    """Train TOP's MADDPG agents (launcher + one per model; TOP §V-B, Alg. 1) against the simulated executor on
    ``--pattern``; every ``--eval-every`` steps the greedy actors are scored on held-out traces (the highest scale
    of the pattern they sustain under ``--slo-ms``), and the best are written, for ``opweave serve --policy top
    --policy-file`` (or, written to ``src/opweave/serve/data/top_<models>.pt``, shipped as the default)."""
    from opweave.learn import policy
    from opweave.schedulers.top_gpg import one_thread
    from opweave.serve.assemble import load_models, parse_image_size, serving_options
    from opweave.serve.engine.simulation import SimExecutor
    from opweave.serve.loadgen import parse_pattern

    rates = parse_pattern(pattern)
    scale_list = _numbers(scales, "--scales", float)
    seeds = _numbers(eval_seeds, "--eval-seeds", int)
    held_out = policy.HeldOut(seeds=tuple(seeds), duration_s=eval_s, slo_ms=slo_ms, max_scale=eval_max_scale)
    start = time.perf_counter()
    served = load_models(list(rates), device="sim", max_batch=max_batch, image_size=parse_image_size(image_size))
    executor = SimExecutor({n: m.blocked for n, m in served.items()}, serving_options("sim"), preset=preset)
    loaded = time.perf_counter()
    curve: list[dict] = []
    with _bar() as bar, one_thread():
        task = bar.add_task("train-policy", total=steps, info="")
        last_eval = ""

        def on_step(i: int, rec: dict) -> None:
            curve.append(rec)
            recent = curve[-100:]
            bar.update(task, advance=1, info=f"reward (last 100) {sum(r['reward'] for r in recent) / len(recent):.3f}"
                       f"  superblocks {sum(r['superblock'] for r in recent)}{last_eval}")

        def on_eval(rec: dict) -> None:
            nonlocal last_eval
            last_eval = f"  held-out scale {rec['scale']:g} at step {rec['step']}"
            bar.update(task, info=last_eval.strip())

        trained = policy.train(executor, rates, steps=steps, period_ms=period_ms, episode_steps=episode_steps,
                               scales=tuple(scale_list), max_queue=max_queue, max_batch=max_batch,
                               max_sub_blocks=max_sub_blocks, warmup=warmup, eval_every=eval_every,
                               held_out=held_out, seed=seed, on_step=on_step, on_eval=on_eval)
    train_s = time.perf_counter() - loaded
    blocks = {m: len(served[m].blocked.blocks) for m in rates}
    meta = {"command": f"opweave train-policy --pattern {pattern} --steps {steps} --period-ms {period_ms:g} "
                       f"--episode-steps {episode_steps} --scales {scales} --warmup {warmup} --eval-every "
                       f"{eval_every} --eval-seeds {eval_seeds} --eval-s {eval_s:g} --eval-max-scale "
                       f"{eval_max_scale:g} --slo-ms {slo_ms:g} --preset {preset} --max-batch {max_batch} "
                       f"--max-queue {max_queue} --max-sub-blocks {max_sub_blocks} --seed {seed}"
                       + (f" --image-size {image_size}" if image_size else ""),
            "pattern": rates, "preset": preset, "train_s": round(train_s, 1), "load_s": round(loaded - start, 1),
            "eval_s": round(sum(e["seconds"] for e in trained.evals), 1), **trained.summary()}
    policy.save_agents(trained.agents, output, blocks=blocks, max_sub_blocks=max_sub_blocks, meta=meta)
    curve_path = (plot or output).with_suffix(".json")
    curve_path.write_text(json.dumps({"meta": meta, "curve": curve, "evals": trained.evals}) + "\n")
    if plot:
        learning_png(plot, {pattern: meta})
    err.print(f"wrote {output} and {curve_path}: {steps} steps in {train_s:.0f} s (+ {loaded - start:.0f} s "
              f"loading); kept step {trained.kept_step}: held-out scale {trained.kept_scale:g} (untrained "
              f"{meta['start_scale']:g})")


def _numbers(text: str, option: str, cast) -> list:
    try:
        values = [cast(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or (cast is float and min(values) <= 0):
        raise UsageError(f"{option} {text!r} must be {'positive ' if cast is float else ''}numbers, comma-separated")
    return values


def learning_png(path: Path, runs: dict[str, dict]) -> None:
    """Learning curves of ``top`` trainings (each a policy file's ``meta``, :meth:`opweave.learn.policy.Trained.
    summary`): above, the launcher's reward (eq. 2) and the share of superblocks, as means over the summary's
    windows; below, the held-out evaluation (the highest scale the greedy actors sustain), the kept one marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top_ax, eval_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for name, meta in runs.items():
        x = [c[0] for c in meta["curve"]]
        line, = top_ax.plot(x, [c[1] for c in meta["curve"]], label=f"{name}: launcher reward", linewidth=1.2)
        top_ax.plot(x, [c[2] for c in meta["curve"]], linestyle=":", color=line.get_color(),
                    label=f"{name}: superblock share")
        evals = meta["evals"]
        eval_ax.plot([e[0] for e in evals], [e[1] for e in evals], marker=".", color=line.get_color(), label=name)
        eval_ax.plot([meta["kept_step"]], [meta["kept_scale"]], marker="*", markersize=12, color=line.get_color())
    top_ax.set(ylabel=f"mean over {next(iter(runs.values()))['curve_every']} steps",
               title="MADDPG training (simulated)")
    eval_ax.set(xlabel="training step (one decision per period)", ylabel="held-out sustained scale",
                title="held-out evaluation (greedy actors; * = kept)")
    for ax in (top_ax, eval_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
