"""Reward against wall-clock seconds (the sum of step times, start-up left out) for the side-by-side runs.

    python bench/plot.py TRL_JSON_LINE_FILE GRPO_METRICS_JSONL OUT.png [TITLE]

TRL_JSON_LINE_FILE holds a JSON line with TRL's step_s and reward lists; GRPO_METRICS_JSONL is the grpo.py run's
metrics.jsonl. Needs matplotlib (not a dependency of grpo.py).
"""
import itertools, json, sys

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

trl = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
ours = [json.loads(line) for line in open(sys.argv[2]) if line.strip()]
fig, ax = plt.subplots(figsize=(6.4, 4))
for label, steps, rewards in [
        (f"TRL {trl['trl_version']} GRPOTrainer", trl["step_s"], trl["reward"]),
        ("grpo.py", [r["timing/train/total_step_time"] for r in ours], [r["train/reward"] for r in ours])]:
    ax.plot(list(itertools.accumulate(steps)), rewards, marker="o", label=label)
ax.set_xlabel("wall-clock seconds (sum of step times)")
ax.set_ylabel("mean reward of the step's samples")
ax.set_ylim(0, 1.05)
ax.set_title(sys.argv[4] if len(sys.argv) > 4 else "SmolLM2-135M-Instruct, 4 x 8 samples per step, fp32, CPU")
ax.grid(alpha=0.3)
ax.legend()
fig.tight_layout()
fig.savefig(sys.argv[3], dpi=100)
print(f"wrote {sys.argv[3]}")
