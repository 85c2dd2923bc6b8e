"""The padded machine floor of the side-by-side work (docs/speed.md): what one step
costs with no trainer around it. vLLM generates 4 prompts x 8 samples (<= 64 new tokens, temperature 1, the engine
settings grpo.py uses), then one plain transformers forward/backward runs over those 32 samples padded to the
longest, the LM head on completion positions only, at the same precision (bfloat16: autocast over fp32 weights).
Prints the median of each over the repeats.

    python bench/floor.py /tmp/grpo-bench/SmolLM2 [float32|bfloat16] [repeats]
"""
import os, random, statistics, sys, time

import torch
import torch.nn.functional as F

model_dir = sys.argv[1]
precision = sys.argv[2] if len(sys.argv) > 2 else "float32"
repeats = int(sys.argv[3]) if len(sys.argv) > 3 else 3
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29517",
                  VLLM_CPU_KVCACHE_SPACE="1", VLLM_LOGGING_LEVEL="WARNING")
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm import LLM, SamplingParams

tokenizer = AutoTokenizer.from_pretrained(model_dir)
llm = LLM(model=model_dir, dtype=precision, seed=0, max_model_len=160, enable_prefix_caching=True,
          enable_chunked_prefill=False, distributed_executor_backend="external_launcher")
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
rng, generation, training, widths = random.Random(0), [], [], []
for repeat in range(repeats + 1):  # the first is a warm-up
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": f"What is {rng.randint(0, 9)} + "
                                               f"{rng.randint(0, 9)}? Put the final answer in \\boxed{{}}."}],
                                             add_generation_prompt=True, return_dict=False) for _ in range(4)]
    requests = [{"prompt_token_ids": list(p)} for p in prompts for _ in range(8)]
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=1000 * repeat + i) for i in range(32)]
    start = time.perf_counter()
    outputs = llm.generate(requests, params, use_tqdm=False)
    generated = time.perf_counter() - start
    samples = [r["prompt_token_ids"] + list(o.outputs[0].token_ids) for r, o in zip(requests, outputs)]
    width = max(map(len, samples))
    ids = torch.tensor([s + [tokenizer.pad_token_id] * (width - len(s)) for s in samples])  # [32, width]
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in samples])
    prompt = len(prompts[0])  # every prompt here has the same length; only completion tokens go through the head
    labels = torch.where(mask.bool(), ids, -100)[:, prompt:]  # [32, width - prompt]
    start = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        logits = model(input_ids=ids, attention_mask=mask, logits_to_keep=width - prompt + 1).logits[:, :-1]
    F.cross_entropy(logits.float().flatten(0, 1), labels.flatten()).backward()
    model.zero_grad(set_to_none=True)
    trained = time.perf_counter() - start
    if repeat:
        generation.append(generated)
        training.append(trained)
        widths.append(width)
    print(f"repeat {repeat}{' (warm-up)' if not repeat else ''}: generation {generated:.1f} s, forward/backward "
          f"{trained:.1f} s over 32 x {width} tokens", flush=True)
g, t = statistics.median(generation), statistics.median(training)
print(f"floor ({precision}): generation {g:.1f} s + forward/backward {t:.1f} s = {g + t:.1f} s "
      f"(median of {repeats}; padded widths {widths})")
