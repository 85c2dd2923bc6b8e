"""The default precision's sampler side, on a CPU without bf16: SmolLM2 on the side-by-side work with vLLM as
`policy.precision=bfloat16` runs it (bf16 weights, each refit casting the fp32 masters stochastically or to nearest)
and the trainer in fp32. A pretrained model starts on the bf16 grid and an update at lr 1e-5 is smaller than half a
bf16 step for most weights: the rounding decides whether the sampler follows the trainer. The trainer's bf16 compute
is emulated on such a CPU (hours for 12 steps); on bf16 hardware run grpo.py at its default precision instead.

    ../shared/bench/side_by_side.sh --no-trl --steps 1     # once: the model, the prompts and the reward in BENCH_DIR
    python bench/rounding.py stochastic|nearest|float32 STEPS [key=value ...]     # float32: vLLM in fp32 too

Prints the reward and the sampler/trainer mismatch (token_mult_prob_error) per step, and the median step time. The
grpo.py arguments below are side_by_side.sh's; extra key=value go to grpo.py.
"""
import copy, json, os, statistics, sys, time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import grpo  # noqa: E402

mode, steps, extra = sys.argv[1], sys.argv[2], sys.argv[3:]
assert mode in ("stochastic", "nearest", "float32"), mode
w = os.environ.get("BENCH_DIR", "/tmp/grpo-bench")
sys.path.insert(0, w)  # boxed_reward.py
log_dir = os.path.join(w, f"rounding_{mode}_{int(time.time())}")
engine_init = grpo.VllmEngine.__init__


def init(self, path, cfg):  # the engine as at the default precision, with this run's rounding
    engine_cfg = copy.deepcopy(cfg)
    engine_cfg.policy.precision, engine_cfg.policy.refit_rounding = "bfloat16", mode
    engine_init(self, path, engine_cfg)


if mode != "float32":
    grpo.VllmEngine.__init__ = init
grpo.main([f"policy.model_name={w}/SmolLM2", f"data.dataset_name={w}/add.jsonl", "data.prompt_template={}",
           "env.reward_fn=boxed_reward:boxed", "env.reward_timeout_s=null", "grpo.num_prompts_per_step=4",
           "grpo.num_generations_per_prompt=8", "policy.train_global_batch_size=32", "policy.train_micro_batch_size=32",
           "policy.logprob_batch_size=32", "policy.generation.max_new_tokens=64", "policy.max_total_sequence_length=160",
           "loss_fn.reference_policy_kl_penalty=0", "policy.optimizer.lr=1e-5", "policy.optimizer.warmup_steps=1",
           "policy.optimizer.weight_decay=0", "grpo.val_period=0", "grpo.val_at_end=false", "grpo.max_val_samples=8",
           "checkpointing.enabled=false", "grpo.seed=0", "policy.precision=float32", f"grpo.max_num_steps={steps}",
           f"logger.log_dir={log_dir}"] + extra)
rows = [json.loads(line) for line in open(os.path.join(log_dir, "metrics.jsonl"))]
print(f"{mode}: reward per step {[round(r['train/reward'], 2) for r in rows]}")
print(f"{mode}: token_mult_prob_error per step {[round(r['train/token_mult_prob_error'], 3) for r in rows]}")
print(f"{mode}: median step {statistics.median(r['timing/train/total_step_time'] for r in rows[1:]):.1f} s, "
      f"generation {statistics.median(r['timing/train/generation'] for r in rows[1:]):.1f} s; {log_dir}")
