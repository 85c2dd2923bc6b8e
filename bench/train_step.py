"""Times grpo.train_step alone on one rollout-sized batch of the side-by-side work (4 prompts x 8 completions,
SmolLM2's 48-token chat prompt, completion lengths drawn from 2..64, one rank), for each micro-batch token budget.

    python bench/train_step.py /tmp/grpo-bench/SmolLM2 [repeats] [precision]
"""

import os, sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import time
import types

import torch
from transformers import AutoTokenizer

import grpo
import plumbing

model_dir, repeats = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2
precision = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
MICRO_BATCHINGS = {
    **{f"packed {n} tokens": [f"policy.sequence_packing.train_mb_tokens={n}"] for n in (256, 512, 1024, 2048, 5120)},
    "packed, the default budget": [],
}
plumbing.setup_distributed(600)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
generator, samples = torch.Generator().manual_seed(0), []
for q in range(4):
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"What is {q} + {q + 3}? Put the final answer in \\boxed{{}}."}],
        add_generation_prompt=True,
        return_dict=False,
    )
    for k in range(8):
        n = int(torch.randint(2, 65, (1,), generator=generator))
        completion = torch.randint(100, 40000, (n,), generator=generator).tolist()
        samples.append(grpo.Sample("", list(prompt), completion, [-1.0] * n, [1] * n, reward=float(k % 2)))
common = [
    f"policy.model_name={model_dir}",
    f"policy.precision={precision}",
    "grpo.num_prompts_per_step=4",
    "grpo.num_generations_per_prompt=8",
    "policy.train_global_batch_size=32",
    "policy.train_micro_batch_size=32",
    "policy.logprob_batch_size=32",
    "policy.max_total_sequence_length=160",
    "policy.generation.max_new_tokens=64",
    "loss_fn.reference_policy_kl_penalty=0",
]
cfg = plumbing.load_config(common + ["policy.optimizer.lr=1e-5"])
model = grpo.load_policy(model_dir, cfg, trainable=True)
optimizer = grpo.make_optimizer(model, cfg)
print(
    f"{sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)} tokens, "
    f"{sum(len(s.completion_ids) for s in samples)} of them generated",
    flush=True,
)
times = {name: [] for name in MICRO_BATCHINGS}
for _ in range(repeats):
    for name, options in MICRO_BATCHINGS.items():
        cfg = plumbing.load_config(common + options)
        batch = grpo.make_batch(samples, cfg, tokenizer.pad_token_id)
        start = time.perf_counter()
        run = types.SimpleNamespace(policy=model, reference=None, optimizer=optimizer, cfg=cfg, tokenizer=tokenizer)
        grpo.train_step(run, batch, step=1)
        times[name].append(time.perf_counter() - start)
for name, seconds in times.items():
    print(f"{name}: " + ", ".join(f"{s:.1f}" for s in seconds) + " s")
