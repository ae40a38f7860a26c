"""Every module imports with only the core dependencies: the optional ones are imported where used."""

from __future__ import annotations

import subprocess
import sys

OPTIONAL = (
    "peft", "bitsandbytes", "torchao", "deepspeed", "matplotlib", "pyarrow", "datasets", "tensorboard", "flash_attn",
    "plotly", "wandb", "mlflow", "liger_kernel",
)

SCRIPT = f"""
import importlib, pkgutil, sys
for name in {OPTIONAL!r}:
    sys.modules[name] = None  # importing it now raises ImportError, as if it were not installed
import memfit
failed = []
for module in pkgutil.walk_packages(memfit.__path__, "memfit."):
    if module.name == "memfit.__main__":
        continue
    try:
        importlib.import_module(module.name)
    except Exception as error:
        failed.append(f"{{module.name}}: {{error!r}}")
print("\\n".join(failed))
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_without_optional_dependencies():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr[-2000:]


def test_missing_optional_dependency_is_one_clear_line(tmp_path):
    """LoRA without peft: exit 2 and what to install in one line, not a traceback; nothing written."""
    out = tmp_path / "out"
    script = (
        "import sys; sys.modules['peft'] = None; from memfit.cli.main import main; "
        f"sys.exit(main(['train', '--lora-r', '4', '--max-steps', '1', '--seq-len', '32', '--output-dir', {str(out)!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and "pip install" in lines[0], result.stderr[-2000:]
    assert not out.exists()


def test_library_train_is_the_function_after_its_modules_were_imported():
    """`from memfit import train` must not turn into the package once memfit.train.* is loaded."""
    code = "import memfit.train.setup\nfrom memfit import train\nassert callable(train), type(train)\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_train_modules_import_by_their_dotted_names():
    """The callable memfit.train package stays a package: `import memfit.train.loop as loop` works."""
    code = "from memfit import train\nimport memfit.train.loop as loop\nassert loop.train is not train\n"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
