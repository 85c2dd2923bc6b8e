"""NeMo-RL GRPO config -> a grpo.py recipe: the values grpo.py takes from it, in grpo.py's keys, each with the NeMo-RL key
it came from, and every key left out, with why.

    python tools/nemo_rl_config.py examples/configs/grpo_math_1B.yaml [key=value ...] > recipe.yaml
    torchrun --nproc_per_node=8 grpo.py --config recipe.yaml

It reads a file as NeMo-RL does (nemo_rl/utils/config.py): `defaults:` names a parent file or a list of them (merged in
order), each relative to the file naming it and with parents of its own, under the file; a section marked
`_override_: true` replaces the parents' section instead of merging into it. key=value arguments (NeMo-RL's keys) go in
next, before the interpolations are resolved, as NeMo-RL applies its command line: `${a.b}`, relative `${.b}`, and
NeMo-RL's resolvers `${mul:x, y}` and `${max:x, y}`. Keys keep their names unless RENAMED says otherwise; a value
grpo.py would refuse (a null where it needs a number) is left out with grpo.py's reason.
"""

import functools
import json
import math
import operator
import os
import re
import sys

import yaml

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import plumbing  # noqa: E402

RENAMED = {  # by prefix: NeMo-RL's key -> grpo.py's
    "policy.optimizer.kwargs.": "policy.optimizer.",  # lr, weight_decay, betas, eps
    "policy.scheduler.0.kwargs.total_iters": "policy.optimizer.warmup_steps",  # a LinearLR: GRPO steps in both
    "policy.dtensor_cfg.lora_cfg.": "policy.lora.",
    "policy.dtensor_cfg.activation_checkpointing": "policy.activation_checkpointing",
    "logger.wandb.": "logger.wandb_",  # project, name
    "data.train.dataset_name": "data.dataset_name",
    "data.default.": "data.",
    "data.prompt_file": "data.prompt_template",  # the file's text
    "data.system_prompt_file": "data.system_prompt",
}


def read(path: str) -> dict:
    """A NeMo-RL YAML file with its parents merged under it."""
    if not os.path.isfile(path):
        sys.exit(f"error: config file not found: {path}")
    with open(path) as f:
        recipe = yaml.safe_load(f) or {}
    parents = recipe.pop("defaults", None) or []
    paths = [os.path.join(os.path.dirname(path), p) for p in ([parents] if isinstance(parents, str) else parents)]
    return functools.reduce(merge, [read(p) for p in paths] + [recipe])


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and value.get("_override_"):  # this section replaces the base's
            out[key] = {k: v for k, v in value.items() if k != "_override_"}
        else:
            both = isinstance(value, dict) and isinstance(out.get(key), dict)
            out[key] = merge(out[key], value) if both else value
    return out


def interpolate(value, root: dict, key: str, path: str):
    """${a.b}, ${.b} (b next to `key`), ${mul:x, y} and ${max:x, y}, innermost first."""
    while isinstance(value, str) and (m := re.search(r"\$\{([^${}]*)\}", value)):
        name, resolver, args = m.group(1).partition(":")
        try:
            if resolver:
                result = {"mul": math.prod, "max": max}[name](yaml.safe_load(f"[{args}]"))
            else:
                name = key.rpartition(".")[0] + name if name.startswith(".") else name
                result = interpolate(functools.reduce(operator.getitem, name.split("."), root), root, name, path)
        except (KeyError, TypeError) as e:
            sys.exit(f"error: {path}: {key}: cannot resolve {m.group(0)} ({type(e).__name__}: {e})")
        value = result if m.group(0) == value else value.replace(m.group(0), str(result))
    return value


def convert(recipe: dict, path: str) -> tuple[dict, dict]:
    """-> ({grpo.py key: (value, NeMo-RL key)}, {NeMo-RL key: why it is left out})."""
    defaults = plumbing.flatten(plumbing.read_yaml(plumbing.CONFIG_YAML))
    policy = recipe.get("policy") or {}
    if isinstance(policy.get("scheduler"), list):  # a list of schedulers: by index
        policy["scheduler"] = {str(i): s for i, s in enumerate(policy["scheduler"])}
    flat, taken, left_out = plumbing.flatten(recipe), {}, {}
    for key, value in flat.items():
        target = next((new + key[len(old) :] for old, new in RENAMED.items() if key.startswith(old)), key)
        if target == "policy.optimizer.warmup_steps" and "LinearLR" not in str(flat.get("policy.scheduler.0.name")):
            target = key  # another schedule: left out
        if target not in defaults:
            left_out[key] = "no such knob in grpo.py"
            continue
        value = interpolate(value, recipe, key, path)
        if key.endswith("_file") and value is not None:  # a prompt file: its text
            if not os.path.isfile(value):
                left_out[key] = f"{value} is not here (give grpo.py its text as {target})"
                continue
            with open(value) as f:
                value = f.read()
        try:
            taken[target] = (plumbing.check_knob(target, value, defaults[target]), key)
        except plumbing.ConfigError as e:
            left_out[key] = str(e)
    if taken.get("checkpointing.metric_name", (None,))[0] == "val:accuracy":  # NeMo-RL's name for grpo.py's default
        left_out[taken.pop("checkpointing.metric_name")[1]] = "NeMo-RL's val:accuracy is grpo.py's val_reward"
    return taken, left_out


def section(key: str, left_out: dict, flat: dict) -> str:
    """The widest section whose keys are all left out for the same reason (`section.*`), else the key."""
    parts = key.split(".")
    for n in range(1, len(parts)):
        prefix = ".".join(parts[:n]) + "."
        if all(left_out.get(k) == left_out[key] for k in flat if k.startswith(prefix)):
            return prefix + "*"
    return key


def render(value) -> str:
    """One YAML value on one line: strings as JSON (YAML reads it), the rest in YAML's flow style."""
    return json.dumps(value) if isinstance(value, str) else yaml.safe_dump([value], default_flow_style=True)[1:-2]


def emit(tree: dict, indent: str = "") -> list[str]:
    """Sections as YAML blocks, each value with its NeMo-RL key as a comment."""
    lines = []
    for name, item in tree.items():
        if isinstance(item, dict):
            lines += [f"{indent}{name}:"] + emit(item, indent + "  ")
        else:
            lines.append(f"{indent}{name}: {render(item[0])}  # {item[1]}")
    return lines


def main(argv: list[str]) -> str:
    path, overrides = argv[0], [arg.partition("=") for arg in argv[1:]]
    recipe = read(path)
    for key, _, value in overrides:  # before the interpolations, as NeMo-RL applies its command line
        recipe = merge(recipe, plumbing.nested(key, yaml.safe_load(value)))
    taken, left_out = convert(recipe, path)
    tree: dict = {}
    for target, item in taken.items():
        *sections, name = target.split(".")
        functools.reduce(lambda d, part: d.setdefault(part, {}), sections, tree)[name] = item
    flat = plumbing.flatten(recipe)
    lines = [f"# grpo.py recipe from the NeMo-RL config {path} (tools/nemo_rl_config.py): each value's NeMo-RL key"]
    lines += emit(tree) + ["# left out:"]
    for shown, why in {section(key, left_out, flat): why for key, why in left_out.items()}.items():
        lines.append(f"#   {shown}: {why}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if not sys.argv[1:]:
        sys.exit(__doc__)
    sys.stdout.write(main(sys.argv[1:]))
