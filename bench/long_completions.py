"""One training micro-batch: the forward + backward the loop runs (grpo.policy_logprobs on the FSDP2 policy, the
default loss, which reads each token's logprob, and the entropy as a metric) against the floor, the leanest way to the
same numbers: each sample alone through plain transformers with causal SDPA, logits for its completion tokens only,
its own fp32 log-softmax, the loss on the logprobs and the entropy computed without gradient. The model is a 2-layer
Llama of hidden size 256, 4 heads of 64, MLP 1024 and a 32k vocabulary, in fp32. Each figure comes from a process of
its own: the time of one forward + backward after a warm-up, and the process's peak resident memory (ru_maxrss)
against its size before.

    python bench/long_completions.py [threads] [points] [key=value ...]   # 1 64x128,32x256,8x1024,4x4096,1x16384

A point BxC is B samples of C completion tokens after one 128-token prompt they share (docs/speed.md). Extra
key=value arguments go to grpo.py's config (policy.logprob_chunk_size=512, for example).
"""

import os, sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import json, resource, subprocess, tempfile, time

import torch
import transformers

PROMPT = 128
SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=4, vocab_size=32000)


def peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def one(model_dir: str, mode: str, point: str, *overrides: str) -> dict:
    """One figure, in this process: 'grpo' (the loop's micro-batch) or 'floor' (each sample alone)."""
    import grpo, plumbing

    n, completion = map(int, point.split("x"))
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, 32000, (PROMPT,), generator=g).tolist()
    ids = [torch.randint(10, 32000, (completion,), generator=g).tolist() for _ in range(n)]
    samples = [grpo.Sample("", prompt, c, [0.0] * completion, [1] * completion) for c in ids]
    input_ids, token_mask, _ = grpo.pack_batch(samples, 0)  # [n, 128 + completion]
    weights = torch.randn(input_ids.shape, generator=g)  # the loss: a weighted sum of the logprobs
    if mode == "grpo":
        plumbing.setup_distributed(600)
        cfg = plumbing.load_config([f"policy.model_name={model_dir}", "policy.precision=float32", *overrides])
        model = grpo.load_policy(model_dir, cfg, trainable=True)

        def step(input_ids, token_mask, weights):
            lp, entropy = grpo.policy_logprobs(model, input_ids, token_mask, cfg)
            (lp * weights).sum().backward()
            return entropy.detach().sum()  # a metric

    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model.config._attn_implementation = "sdpa"

        def step(input_ids, token_mask, weights):
            metric = 0.0
            for i in range(len(input_ids)):  # one sample at a time, each with its prompt
                keep = input_ids.shape[1] - PROMPT + 1
                logits = model(input_ids=input_ids[i : i + 1], logits_to_keep=keep).logits[0, :-1]
                logp = torch.log_softmax(logits.float(), -1)  # [completion, V]
                lp = logp.gather(1, input_ids[i, PROMPT:, None])[:, 0]
                with torch.no_grad():  # a metric
                    metric += -(logp.exp() * logp).sum()
                (lp * weights[i, PROMPT:]).sum().backward()
            return metric

    step(input_ids[:1, : PROMPT + 16], token_mask[:1, : PROMPT + 16], weights[:1, : PROMPT + 16])  # warm-up
    model.zero_grad(set_to_none=True)
    before = peak_gb()
    start = time.perf_counter()
    step(input_ids, token_mask, weights)
    seconds = time.perf_counter() - start
    return {"mode": mode, "point": point, "seconds": seconds, "peak_gb": peak_gb(), "before_gb": before}


def main() -> None:
    threads = sys.argv[1] if len(sys.argv) > 1 else "1"
    points = (sys.argv[2] if len(sys.argv) > 2 else "64x128,32x256,8x1024,4x4096,1x16384").split(",")
    overrides = sys.argv[3:]
    with tempfile.TemporaryDirectory() as model_dir:
        config = transformers.LlamaConfig(**SHAPE, max_position_embeddings=PROMPT + 16384, tie_word_embeddings=False)
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(model_dir)
        cpu = next((line.split(":")[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
        flags = open("/proc/cpuinfo").read()
        native = "avx512_bf16" in flags or "amx" in flags
        print(f"{cpu} ({'native' if native else 'no'} bf16), torch {torch.__version__}, {threads} thread(s), fp32")
        print(f"model: {SHAPE}; each point one forward + backward after a warm-up; overrides: {overrides or 'none'}")
        print(f"{'point':>9} | {'grpo.py':>21} | {'floor':>21} | ratio (time, memory)")
        env = {**os.environ, "OMP_NUM_THREADS": threads, "TORCH_CPP_LOG_LEVEL": "ERROR"}
        for point in points:
            figures = {}
            for mode in ("grpo", "floor"):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", model_dir, mode, point, *overrides],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
                if out.returncode or not lines:
                    sys.exit(f"{mode} {point} failed: {out.stderr[-2000:]}")
                figures[mode] = json.loads(lines[-1])
            a, b = figures["grpo"], figures["floor"]
            grown = [f["peak_gb"] - f["before_gb"] for f in (a, b)]
            print(
                f"{point:>9} | {a['seconds']:6.1f} s {a['peak_gb']:5.2f} GB (+{grown[0]:.2f}) |"
                f" {b['seconds']:6.1f} s {b['peak_gb']:5.2f} GB (+{grown[1]:.2f}) |"
                f" {a['seconds'] / b['seconds']:.2f}x, {a['peak_gb'] / b['peak_gb']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    if sys.argv[1:2] == ["--one"]:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        print(json.dumps(one(*sys.argv[2:])), flush=True)
    else:
        main()
