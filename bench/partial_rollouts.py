"""Partial rollouts against synchronous GRPO on a long tail of completion lengths, one sitting, same seed.

SmolLM2-135M-Instruct on the arithmetic task, asked for brief answers: 4 prompts x 8 completions per step, <= 256 new
tokens (most end within 40, a few run to the limit), one update per step. Per mode it prints each step (generation
and step time, reward, groups dropped, samples the engine finished and how many of them ran out of tokens), then a
summary: trained samples per second of wall clock (the steps' time), mean reward, groups dropped per step, and the
truncation rate over every finished sample beside the one over trained samples (metrics.jsonl's, which misses what a
drop throws away). Last, on paper, for GPUs whose decode step costs the same whatever the batch (memory-bound): the
engine steps per training step at the default config's batch on 8 GPUs, from the measured length distribution.

    python bench/smollm2.py /tmp/grpo-bench/SmolLM2                       # the model, once
    python bench/partial_rollouts.py /tmp/grpo-bench/SmolLM2 12 --modes sync partial partial_3x_age2

The finished-sample counts come from `bench/finished` and `bench/finished_truncated` in metrics.jsonl where the
grpo.py under test logs them (a patch of four lines used for the before/after figures, not part of grpo.py); without
them the table shows the trained samples' rate only.
"""

import json
import math
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "bench"))
from smollm2 import materialize  # noqa: E402

args = [a for a in sys.argv[1:] if "=" not in a]
model = args[0] if args else "/tmp/grpo-bench/SmolLM2"
steps = int(args[1]) if len(args) > 1 and args[1].isdigit() else 12
modes = args[args.index("--modes") + 1 :] if "--modes" in args else ["sync", "partial"]
extra = [a for a in sys.argv[1:] if "=" in a]
PARTIAL = ["grpo.partial_rollouts.enabled=true", "grpo.batch_multiplier=2"]  # 2x in flight, age <= 1 (the default)
MODES = {
    "sync": [],
    "partial": PARTIAL,
    "partial_3x": PARTIAL + ["grpo.batch_multiplier=3"],  # refused: a group lives 2 steps, so 3x would drop groups
    "partial_3x_age2": PARTIAL + ["grpo.batch_multiplier=3", "grpo.partial_rollouts.max_trajectory_age_steps=2"],
    "partial_is": PARTIAL + ["loss_fn.use_importance_sampling_correction=true"],
}
materialize(model)
# Asked this, SmolLM2-135M answers in ~30 tokens and now and then runs on to the limit: a long tail. Asked to think
# step by step (config.yaml's template) it runs a quarter of its completions to the limit: almost every group of 8
# then has one, and no group finishes early.
TEMPLATE = "{} Answer briefly, with the result in \\boxed{{}}."
os.makedirs("/tmp/grpo-bench", exist_ok=True)
with open("/tmp/grpo-bench/bench_rewards.py", "w") as f:  # 0.5 for a \boxed{} at all, beside the answer's 1.0
    f.write("def boxed(prompt, completion, answer):\n    return 0.5 if '\\\\boxed{' in completion else 0.0\n")
common = [
    f"policy.model_name={model}",
    "data.dataset_name=examples.arithmetic:task",
    f"data.prompt_template={TEMPLATE}",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=8",
    "policy.train_global_batch_size=32",
    "policy.generation.max_new_tokens=256",
    "policy.max_total_sequence_length=384",
    "loss_fn.reference_policy_kl_penalty=0",
    "policy.optimizer.lr=1e-5",
    "policy.optimizer.warmup_steps=1",
    "grpo.val_period=0",
    "grpo.val_at_end=false",
    "grpo.max_val_samples=8",
    "checkpointing.enabled=false",
    "env.reward_timeout_s=null",
    "env.reward_fn=[grpo:math_reward, bench_rewards:boxed]",
    "grpo.seed=0",
    f"grpo.max_num_steps={steps}",
]
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
bf16 = "native bf16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "bf16 emulated"
print(f"CPU: {cpu} ({bf16}), {os.cpu_count()} cores; {steps} steps per mode; extra: {extra}")
runs = {}
for mode in modes:
    log_dir = f"/tmp/grpo-bench/partial_{mode}_{int(time.time())}"
    start = time.perf_counter()
    command = [sys.executable, "grpo.py", *common, *MODES[mode], *extra, f"logger.log_dir={log_dir}"]
    env = {**os.environ, "PYTHONPATH": "/tmp/grpo-bench"}
    result = subprocess.run(command, cwd=HERE, capture_output=True, text=True, env=env)
    if result.returncode:
        print(f"\n{mode}: exit {result.returncode}: {result.stderr.strip().splitlines()[-1]}")
        continue
    metrics = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    lengths = [
        len(json.loads(line)["generation_logprobs"])
        for step in range(1, steps + 1)
        for line in open(os.path.join(log_dir, f"train_data_step{step}.jsonl"))
    ]
    runs[mode] = metrics, lengths, time.perf_counter() - start
    print(f"\n{mode}: step | generation s | step s | reward | dropped | finished | of them truncated | trained trunc.")
    for m in metrics:
        print(
            f"  {m['step']:2d} | {m['timing/train/generation']:6.1f} | {m['timing/train/total_step_time']:6.1f} | "
            f"{m['train/reward']:.3f} | {m.get('train/partial_rollouts/groups_dropped', 0):.0f} | "
            f"{m.get('bench/finished', math.nan):.0f} | {m.get('bench/finished_truncated', math.nan):.0f} | "
            f"{m['train/truncation_rate']:.3f}"
        )

print(
    "\nmode | median generation s | median step s | trained samples/s | mean reward | groups dropped per step | "
    "truncation rate: every finished sample, trained samples | mean trained completion tokens | process s"
)
for mode, (metrics, lengths, wall) in runs.items():
    total = sum(m["timing/train/total_step_time"] for m in metrics)
    finished = sum(m.get("bench/finished", math.nan) for m in metrics)
    truncated = sum(m.get("bench/finished_truncated", math.nan) for m in metrics)
    print(
        f"{mode} | {statistics.median(m['timing/train/generation'] for m in metrics):.1f} | "
        f"{statistics.median(m['timing/train/total_step_time'] for m in metrics):.1f} | "
        f"{32 * len(metrics) / total:.3f} | {statistics.mean(m['train/reward'] for m in metrics):.3f} | "
        f"{statistics.mean(m.get('train/partial_rollouts/groups_dropped', 0) for m in metrics):.2f} | "
        f"{truncated / finished:.3f} ({truncated:.0f} of {finished:.0f}), "
        f"{statistics.mean(m['train/truncation_rate'] for m in metrics):.3f} | {statistics.mean(lengths):.1f} | "
        f"{wall:.0f}"
    )
if "sync" in runs:
    sync_total = sum(m["timing/train/total_step_time"] for m in runs["sync"][0])
    for mode, (metrics, lengths, _) in runs.items():
        total = sum(m["timing/train/total_step_time"] for m in metrics)
        print(
            f"{mode} / sync: trained samples/s {sync_total / total:.2f}x, trained completion tokens/s "
            f"{sum(lengths) / total / (sum(runs['sync'][1]) / sync_total):.2f}x"
        )

# The completion lengths the first mode sampled (synchronous: every sample it generated is trained).
lengths = sorted(next(iter(runs.values()))[1])
q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]  # noqa: E731
print(
    f"\ncompletion lengths ({next(iter(runs))}, {len(lengths)} samples): p10 {q(0.1)}, p50 {q(0.5)}, p90 {q(0.9)}, "
    f"p99 {q(0.99)}, max {lengths[-1]}; at the 256 limit: {sum(n >= 256 for n in lengths) / len(lengths):.1%}"
)


def engine_steps(rng, multiplier: float, max_age: int, quota=4, n=16, steps=2000) -> tuple[float, float]:
    """grpo.py's rule on one engine (a rank), decode steps per training step and groups dropped per step: each engine
    step every running sample makes one token; a step ends once `quota` groups are done and every group that would be
    past the age limit next step is done too (groups are trained oldest first)."""
    carried, total, dropped = [], 0, 0
    for step in range(steps):
        groups = carried + [(step, [rng.choice(lengths) for _ in range(n)]) for _ in range(round(multiplier * quota) - len(carried))]
        ends = [max(left) for _, left in groups]  # a group is done once its longest sample is
        oldest = sorted(range(len(groups)), key=lambda i: groups[i][0])
        cost = sorted(ends)[quota - 1]
        cost = max([cost] + [ends[i] for i in oldest if step - groups[i][0] >= max_age])
        done = [i for i in oldest if ends[i] <= cost][:quota]
        kept = [i for i in range(len(groups)) if i not in done and step + 1 - groups[i][0] <= max_age]
        dropped += len(groups) - len(done) - len(kept)
        carried = [(groups[i][0], [max(0, x - cost) for x in groups[i][1]]) for i in kept]
        total += cost
    return total / steps, dropped / steps


sync = engine_steps(random.Random(0), 1, 0)[0]
for multiplier, max_age in ((1.5, 1), (2, 1), (3, 2)):
    partial, dropped = engine_steps(random.Random(0), multiplier, max_age)
    print(
        f"on paper, 8 GPUs, 32 prompts x 16 per step (4 groups per GPU), flat decode cost: {sync:.0f} engine steps per "
        f"training step synchronous, {partial:.0f} with partial rollouts ({multiplier}x in flight, age <= {max_age}): "
        f"generation {sync / partial:.2f}x faster, {dropped:.2f} groups dropped per step per GPU"
    )
