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

ModelsOpt = Annotated[str, typer.Option("--models", help="comma list of zoo models")]
SeedOpt = Annotated[int, typer.Option("--seed")]
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
              preset: Annotated[str, typer.Option("--device-preset", help="roofline preset")] = "h100",
              samples: Annotated[int, typer.Option("--samples", min=1, help="rollouts per chunk and graph")] = 4,
              lr: Annotated[float, typer.Option("--lr", min=0.0, help="Adam's first learning rate (falls "
                                                "linearly to a tenth over the run)")] = 1e-3,
              validate_every: Annotated[int, typer.Option("--validate-every", min=1)] = 250,
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
                       f"--device-preset {preset} --samples {samples} --lr {lr:g} --validate-every {validate_every}",
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
def train_policy(pattern: Annotated[str, typer.Option("--pattern", help="MODEL:RATE,... requests per second")],
                 output: Annotated[Path, typer.Option("--output", "-o", help="policy file to write")],
                 steps: Annotated[int, typer.Option("--steps", min=1, help="decisions (MADDPG steps)")] = 3000,
                 period_ms: Annotated[float, typer.Option("--period-ms", min=0.1, help="virtual time per step")
                                      ] = 50.0,
                 episode_steps: Annotated[int, typer.Option("--episode-steps", min=1)] = 40,
                 scales: Annotated[str, typer.Option("--scales", help="pattern scales drawn per episode")
                                   ] = "1,2,4,8",
                 warmup: Annotated[int | None, typer.Option("--warmup", min=1, help="transitions before the "
                                                            "first update (default: one batch)")] = None,
                 preset: Annotated[str, typer.Option("--device-preset", help="roofline preset")] = "h100",
                 max_batch: Annotated[int, typer.Option("--max-batch", min=1)] = 16,
                 max_queue: Annotated[int, typer.Option("--max-queue", min=1)] = 64,
                 max_sub_blocks: Annotated[int, typer.Option("--max-sub-blocks", min=1, help="H")] = 4,
                 image_size: Annotated[str | None, typer.Option("--image-size", help="N, or N,MODEL=N,...")
                                       ] = None,
                 seed: SeedOpt = 0, plot: PlotOpt = None):
    """Train TOP's MADDPG agents (launcher + one per model; TOP §V-B, Alg. 1) against the simulated executor on
    ``--pattern``; write the actors for ``opweave serve --policy top --policy-file``."""
    from opweave.learn import policy
    from opweave.schedulers.top_gpg import one_thread
    from opweave.serve.build import load_models, parse_image_size
    from opweave.serve.executors import SimExecutor
    from opweave.serve.loadgen import parse_pattern

    rates = parse_pattern(pattern)
    try:
        scale_list = tuple(float(s) for s in scales.split(",") if s.strip())
    except ValueError:
        scale_list = ()
    if not scale_list or min(scale_list) <= 0:
        raise UsageError(f"--scales {scales!r} must be positive numbers, comma-separated")
    start = time.perf_counter()
    served = load_models(list(rates), device="sim", max_batch=max_batch, image_size=parse_image_size(image_size))
    executor = SimExecutor({n: m.blocked for n, m in served.items()}, preset=preset)
    loaded = time.perf_counter()
    curve: list[dict] = []
    with _bar() as bar, one_thread():
        task = bar.add_task("train-policy", total=steps, info="")

        def on_step(i: int, rec: dict) -> None:
            curve.append(rec)
            recent = curve[-100:]
            bar.update(task, advance=1, info=f"reward (last 100) {sum(r['reward'] for r in recent) / len(recent):.3f}"
                       f"  superblocks {sum(r['superblock'] for r in recent)}")

        agents, _ = policy.train(executor, rates, steps=steps, period_ms=period_ms, episode_steps=episode_steps,
                                 scales=scale_list, max_queue=max_queue, max_batch=max_batch,
                                 max_sub_blocks=max_sub_blocks, warmup=warmup, seed=seed, on_step=on_step)
    train_s = time.perf_counter() - loaded
    blocks = {m: len(served[m].blocked.blocks) for m in rates}
    meta = {"command": f"opweave train-policy --pattern {pattern} --steps {steps} --period-ms {period_ms:g} "
                       f"--episode-steps {episode_steps} --scales {scales} --device-preset {preset} --max-batch "
                       f"{max_batch} --max-queue {max_queue} --max-sub-blocks {max_sub_blocks} --seed {seed}"
                       + (f" --image-size {image_size}" if image_size else "") + (f" --warmup {warmup}"
                                                                                  if warmup else ""),
            "train_s": round(train_s, 1), "load_s": round(loaded - start, 1), "steps": steps,
            "updates": agents.updates, "kept_step": agents.kept_step}
    policy.save_agents(agents, output, blocks=blocks, max_sub_blocks=max_sub_blocks, meta=meta)
    curve_path = (plot or output).with_suffix(".json")
    curve_path.write_text(json.dumps({"meta": meta, "curve": curve}) + "\n")
    if plot:
        window = 100
        smooth = [sum(r["reward"] for r in curve[max(0, i - window + 1):i + 1]) / min(window, i + 1)
                  for i in range(len(curve))]
        sb = [sum(r["superblock"] for r in curve[max(0, i - window + 1):i + 1]) / min(window, i + 1)
              for i in range(len(curve))]
        x = [r["step"] for r in curve]
        _curve_png(plot, {f"launcher reward, eq. (2) (mean of last {window})": (x, smooth),
                          f"superblock share (last {window})": (x, sb)}, f"MADDPG training on {pattern}",
                   "reward / share", "step")
    err.print(f"wrote {output} and {curve_path}: {steps} steps in {train_s:.0f} s (+ {loaded - start:.0f} s loading)")
