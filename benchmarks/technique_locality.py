"""How local each memory technique is in the source: the modules that read its setting, and the long functions.

For each technique's setting (a field of the config) it counts the modules under src/memfit that read it
straight from the config (`config.memory.tiled_mlp`, `cfg.lora.lora_r`, `getattr(config.memory, "tiled_mlp")`)
and the modules that name it at all (an attribute, a variable, a keyword or a string of that name). It also lists
the functions longer than --max-lines in train/ and prediction/ (a function whose docstring's first line says
why it is long is listed apart), and counts the memfit imports made inside functions.

    python benchmarks/technique_locality.py             # a table on stdout
    python benchmarks/technique_locality.py --json      # the same, as one JSON object

The goal it measures against (docs/architecture.md): a setting read from the config in at most 2 modules (its
technique's and the resolver), named in at most 6.
"""

from __future__ import annotations

import argparse
import ast
import json
import statistics
import sys
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent / "src" / "memfit"
# The config's sections as code reaches them (`config.<section>.<field>`).
SECTIONS = {"model", "data", "optimizer", "training", "memory", "lora", "output", "distributed", "eval", "task"}
# The settings that choose a memory technique (or how one runs).
TECHNIQUE_SETTINGS = (
    "gradient_checkpointing", "checkpoint_every", "loss_chunk_size", "optimizer_in_backward", "activation_offload",
    "activation_offload_blocks", "optimizer_offload", "expert_offload", "embedding_on_host", "expert_dequant_group",
    "tiled_mlp", "efficient_norm", "efficient_lora", "compile", "kernels", "packing", "precision", "attention",
    "rope_scale", "lora_r", "quantize", "quantize_head", "optimizer", "memory_cap",
)
# Modules that only declare or load the settings: counted apart.
DECLARING = {"config.py", "config_sections.py", "config_loading.py"}


def reads_from_config(node: ast.AST, field: str) -> bool:
    """`<anything>.<section>.<field>` or `getattr(<anything>.<section>, "<field>"...)`."""
    if isinstance(node, ast.Attribute) and node.attr == field:
        owner = node.value
        return isinstance(owner, ast.Attribute) and owner.attr in SECTIONS
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
        owner, name = node.args[0], node.args[1] if len(node.args) > 1 else None
        return (isinstance(owner, ast.Attribute) and owner.attr in SECTIONS and isinstance(name, ast.Constant)
                and name.value == field)
    return False


def names(node: ast.AST, field: str) -> bool:
    """The setting's value read or written by its name: `x.field`, `field=...`, `x["field"]`, `x.get("field")`,
    `{"field": ...}` or `getattr(x, "field")` (a local variable or a parameter of that name is not counted)."""
    if isinstance(node, ast.Attribute):
        return node.attr == field
    if isinstance(node, ast.keyword):
        return node.arg == field
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == field
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[-1 if _is_getattr(node) else 0],
                                                               ast.Constant):
        named = node.args[1] if _is_getattr(node) and len(node.args) > 1 else node.args[0]
        is_get = isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop", "setdefault")
        return (is_get or _is_getattr(node)) and isinstance(named, ast.Constant) and named.value == field
    if isinstance(node, ast.Dict):
        return any(isinstance(key, ast.Constant) and key.value == field for key in node.keys)
    return False


def _is_getattr(node: ast.Call) -> bool:
    return isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr", "setattr")


def owners() -> dict[str, set[str]]:
    """Setting -> the modules of the technique that owns it (the registry's TECHNIQUE objects and their hooks)."""
    import inspect

    sys.path.insert(0, str(SOURCE.parent))
    try:
        from memfit.resolution.registry import techniques
    except ImportError:  # a tree from before the registry: no technique owns a setting
        return {}

    found: dict[str, set[str]] = {}
    for technique in techniques():
        hooks = [technique.resolve, technique.refusals, technique.apply, technique.report, technique.memory_terms,
                 technique.speed_terms, technique.planner_values]
        modules = {str(Path(inspect.getfile(hook)).relative_to(SOURCE)) for hook in hooks if hook is not None}
        for setting in technique.settings:
            found.setdefault(setting, set()).update(modules)
    return found


def measure() -> dict:
    trees = {str(path.relative_to(SOURCE)): ast.parse(path.read_text()) for path in sorted(SOURCE.rglob("*.py"))}
    owned = owners()
    settings = {}
    for field in TECHNIQUE_SETTINGS:
        from_config, at_all = [], []
        for module, tree in trees.items():
            if Path(module).name in DECLARING and "/" not in module:
                continue
            nodes = list(ast.walk(tree))
            if any(reads_from_config(n, field) for n in nodes):
                from_config.append(module)
            if any(names(n, field) for n in nodes):
                at_all.append(module)
        own = sorted(owned.get(field, ()))
        settings[field] = {"own_modules": own, "from_config": from_config,
                           "from_config_elsewhere": [m for m in from_config if m not in own], "at_all": at_all}
    return {"settings": settings, "long_functions": long_functions(trees), "imports_in_functions":
            imports_in_functions(trees)}


def long_functions(trees: dict[str, ast.Module], max_lines: int = 80) -> list[dict]:
    found = []
    for module, tree in trees.items():
        if not module.startswith(("train/", "prediction/")):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > max_lines:
                    doc = (ast.get_docstring(node) or "").splitlines()
                    found.append({"function": f"{module}:{node.name}", "lines": length,
                                  "says_why": bool(doc) and "long" in doc[0].lower()})
    return sorted(found, key=lambda f: -f["lines"])


def imports_in_functions(trees: dict[str, ast.Module]) -> int:
    count = 0
    for tree in trees.values():
        for function in ast.walk(tree):
            if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                for node in ast.walk(function):
                    if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memfit"):
                        count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--src", type=Path, help="another tree's src/memfit to measure (default: this one's)")
    options = parser.parse_args()
    if options.src is not None:
        global SOURCE
        SOURCE = options.src.resolve()
    result = measure()
    if options.json:
        print(json.dumps(result, indent=1))
        return 0
    rows = result["settings"]
    print(f"{'setting':<28}{'from config':>12}{'elsewhere':>10}{'at all':>8}  read from the config outside its own module")
    for field, entry in rows.items():
        print(f"{field:<28}{len(entry['from_config']):>12}{len(entry['from_config_elsewhere']):>10}"
              f"{len(entry['at_all']):>8}  {', '.join(entry['from_config_elsewhere'])}")
    print(f"{'median':<28}{statistics.median(len(e['from_config']) for e in rows.values()):>12}"
          f"{statistics.median(len(e['from_config_elsewhere']) for e in rows.values()):>10}"
          f"{statistics.median(len(e['at_all']) for e in rows.values()):>8}")
    print(f"\nfunctions over 80 lines in train/ and prediction/: {len(result['long_functions'])}")
    for entry in result["long_functions"]:
        print(f"  {entry['lines']:>4}  {entry['function']}{'  (says why)' if entry['says_why'] else ''}")
    print(f"\nmemfit imports inside functions: {result['imports_in_functions']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
