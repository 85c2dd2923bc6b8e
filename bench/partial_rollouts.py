"""Partial rollouts against synchronous GRPO, one sitting, same seed: SmolLM2-135M-Instruct on the arithmetic task
asked for brief answers, 4 prompts x 8 completions per step, <= 256 new tokens (most end early, a few
run to the limit), one update per step. Prints per step: generation time, step time, reward and the staleness
metrics; then trained samples per second of wall clock (the steps' time), the completion length distribution, and
on paper, for GPUs whose decode step costs the same whatever the batch (memory-bound), the engine steps per
training step with and without at the default config's batch on 8 GPUs, from that distribution.

    python bench/partial_rollouts.py [/tmp/grpo-bench/SmolLM2] [steps] [key=value ...]   # then extra modes:
    python bench/partial_rollouts.py /tmp/grpo-bench/SmolLM2 12 --modes sync partial partial_is
"""
import json, math, os, random, statistics, subprocess, sys, time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
args = [a for a in sys.argv[1:] if "=" not in a]
model = args[0] if args else "/tmp/grpo-bench/SmolLM2"
steps = int(args[1]) if len(args) > 1 and args[1].isdigit() else 12
modes = args[args.index("--modes") + 1 :] if "--modes" in args else ["sync", "partial"]
extra = [a for a in sys.argv[1:] if "=" in a]
MODES = {
    "sync": [],
    "partial": ["grpo.partial_rollouts.enabled=true"],
    "partial_2x": ["grpo.partial_rollouts.enabled=true", "grpo.partial_rollouts.batch_multiplier=2"],
    "partial_is": ["grpo.partial_rollouts.enabled=true", "loss_fn.use_importance_sampling_correction=true"],
}
if not os.path.exists(os.path.join(model, "config.json")):
    subprocess.run([sys.executable, os.path.join(HERE, "..", "shared", "tools", "smollm2.py"), model], check=True)
# SmolLM2-135M asked this answers in ~30 tokens, and now and then runs on to the limit: a long tail. Asked to think
# step by step (config.yaml's template) it runs a quarter of its completions to the limit: almost every group of 8
# then has one, and no group finishes early (pass data.prompt_template=... to see it).
TEMPLATE = "{} Answer briefly, with the result in \\boxed{{}}."
# Rewards: the answer (math_reward, which SmolLM2-135M almost never gets) plus 0.5 for using \boxed{} at all.
os.makedirs("/tmp/grpo-bench", exist_ok=True)
with open("/tmp/grpo-bench/bench_rewards.py", "w") as f:
    f.write("def boxed(prompt, completion, answer):\n    return 0.5 if '\\\\boxed{' in completion else 0.0\n")
common = [
    f"policy.model_name={model}", "data.dataset_name=arithmetic", f"data.prompt_template={TEMPLATE}", "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=32", "policy.generation.max_new_tokens=256",
    "policy.max_total_sequence_length=384", "loss_fn.reference_policy_kl_penalty=0", "policy.optimizer.lr=1e-5",
    "policy.optimizer.warmup_steps=1", "grpo.val_period=0", "grpo.val_at_end=false", "grpo.max_val_samples=8",
    "checkpointing.enabled=false", "env.reward_timeout_s=null", "env.reward_fn=[grpo:math_reward, bench_rewards:boxed]", "grpo.seed=0", f"grpo.max_num_steps={steps}",
]
cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
bf16 = "native bf16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "bf16 emulated"
print(f"CPU: {cpu} ({bf16}), {os.cpu_count()} cores; {steps} steps per mode; extra: {extra}")
runs = {}
for mode in modes:
    log_dir = f"/tmp/grpo-bench/partial_{mode}_{int(time.time())}"
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "grpo.py", *common, *MODES[mode], *extra, f"logger.log_dir={log_dir}"],
                            cwd=HERE, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": "/tmp/grpo-bench"})
    assert result.returncode == 0, result.stderr[-3000:]
    metrics = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    lengths = [len(json.loads(line)["generation_logprobs"]) for step in range(1, steps + 1)
               for line in open(os.path.join(log_dir, f"train_data_step{step}.jsonl"))]
    runs[mode] = metrics, lengths, time.perf_counter() - start
    print(f"\n{mode}: step | generation s | step s | reward | mean age | max age | resumed share | carried | dropped")
    for m in metrics:
        p = "train/partial_rollouts/"
        print(f"  {m['step']:2d} | {m['timing/train/generation']:6.1f} | {m['timing/train/total_step_time']:6.1f} | "
              f"{m['train/reward']:.3f} | {m.get(p + 'token_age_mean', 0):.2f} | {m.get(p + 'token_age_max', 0):.0f} | "
              f"{m.get(p + 'resumed_token_share', 0):.2f} | {m.get(p + 'groups_carried', 0):.0f} | "
              f"{m.get(p + 'groups_dropped', 0):.0f}")

print("\nmode | median generation s | median step s | trained samples/s (all steps) | mean reward | mean trained "
      "completion tokens | process s")
for mode, (metrics, lengths, wall) in runs.items():
    total = sum(m["timing/train/total_step_time"] for m in metrics)
    print(f"{mode} | {statistics.median(m['timing/train/generation'] for m in metrics):.1f} | "
          f"{statistics.median(m['timing/train/total_step_time'] for m in metrics):.1f} | {32 * len(metrics) / total:.3f} | "
          f"{statistics.mean(m['train/reward'] for m in metrics):.3f} | {statistics.mean(lengths):.1f} | {wall:.0f}")
if "sync" in runs and "partial" in runs:
    for mode, (metrics, lengths, _) in runs.items():
        total = sum(m["timing/train/total_step_time"] for m in metrics)
        sync_total = sum(m["timing/train/total_step_time"] for m in runs["sync"][0])
        print(f"{mode} / sync: trained samples/s {sync_total / total:.2f}x, trained completion tokens/s "
              f"{sum(lengths) / total / (sum(runs['sync'][1]) / sync_total):.2f}x")

# The completion lengths the synchronous run sampled (its trained samples are every sample it generated).
lengths = sorted(runs[modes[0]][1])
q = lambda f: lengths[min(len(lengths) - 1, int(f * len(lengths)))]
print(f"\ncompletion lengths ({modes[0]}, {len(lengths)} samples): p10 {q(0.1)}, p50 {q(0.5)}, p90 {q(0.9)}, "
      f"p99 {q(0.99)}, max {lengths[-1]}; at the 256 limit: {sum(n >= 256 for n in lengths) / len(lengths):.1%}")
print("histogram (32-token bins): " + " ".join(str(sum(b * 32 <= n < (b + 1) * 32 for n in lengths)) for b in range(8))
      + f" | 256: {sum(n >= 256 for n in lengths)}")


def engine_steps(partial: bool, rng, quota=4, n=16, multiplier=1.5, max_age=1, steps=2000) -> float:
    """Decode steps per training step on one engine (a rank): each step every running sample makes one token."""
    carried, total = [], 0
    for step in range(steps):
        groups = [g for g in carried if step - g[0] <= max_age] if partial else []
        groups += [(step, [rng.choice(lengths) for _ in range(n)]) for _ in range(
            (math.ceil(multiplier * quota) if partial else quota) - len(groups))]
        # A group is done once its longest sample is; an engine step costs the same for any batch.
        cost = sorted(max(left) for _, left in groups)[quota - 1]
        done = [i for i, (_, left) in enumerate(groups) if max(left) <= cost][:quota]  # oldest first, as grpo.py
        carried = [(start, [max(0, x - cost) for x in left]) for i, (start, left) in enumerate(groups) if i not in done]
        total += cost
    return total / steps


for multiplier in (1.5, 2.0):
    rng = random.Random(0)
    sync_steps, partial_steps = engine_steps(False, rng), engine_steps(True, rng, multiplier=multiplier)
    print(f"on paper, 8 GPUs, 32 prompts x 16 per step (4 groups per GPU), flat decode cost: {sync_steps:.0f} engine "
          f"steps per training step synchronous, {partial_steps:.0f} with partial rollouts ({multiplier}x in flight, "
          f"age <= 1): generation {sync_steps / partial_steps:.2f}x faster")
