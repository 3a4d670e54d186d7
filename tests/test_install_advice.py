"""One install advice (issue 58 item 3, issue 60 item 4): version.py holds the install command per Python version;
its messages and README.md's quick start use it; the megatron-core release it names satisfies setup.py's pin and is
the one pip installed here; transformers comes with the extra that needs it, and without it the error says what to
install; a small shipped config fits a small corpus, and the refusal of a larger one names it."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np
import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from megatron_wlb.config import load_config
from megatron_wlb.megatron.args import version as megatron_version
from megatron_wlb.megatron.args.version import (
    CORE_WHEEL_RELEASE,
    INSTALL_PYTHONS,
    core_install_command,
    install_command,
    training_import_error,
)

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SETUP = (ROOT / "setup.py").read_text()


def megatron_extra() -> list[str]:
    """setup.py's [megatron] extra, its literal requirements (read, not run)."""
    block = re.search(r'"megatron": \[(.*?)\]', SETUP, re.S)
    assert block is not None
    return re.findall(r'"([^"]+)"', block.group(1))


def quick_start() -> str:
    return README[README.index("## Quick start"):README.index("\n## ", README.index("## Quick start") + 1)]


def test_the_advised_release_satisfies_setup_pys_pin_and_is_the_one_pip_installed():
    (pin,) = [r for r in megatron_extra() if r.startswith("megatron-core")]
    assert Version(CORE_WHEEL_RELEASE) in SpecifierSet(pin.removeprefix("megatron-core"))
    assert CORE_WHEEL_RELEASE in megatron_version.TESTED_RELEASES
    try:
        installed = version("megatron-core")  # the wheel's metadata: what pip installed from the index here
    except PackageNotFoundError:
        pytest.skip("no megatron-core wheel installed here")
    assert installed == CORE_WHEEL_RELEASE


def test_one_command_per_python_and_the_readme_shows_exactly_them():
    assert INSTALL_PYTHONS == ((3, 12), (3, 11))
    assert "--ignore-requires-python" in core_install_command((3, 11))
    assert "--ignore-requires-python" not in core_install_command((3, 12))
    assert install_command((3, 12)) == 'python -m pip install -e ".[megatron]"'
    assert install_command((3, 11)).endswith(core_install_command((3, 11)))
    block = re.search(r"1\. \*\*Install\*\*.*?```bash\n(.*?)```", quick_start(), re.S)
    assert block is not None
    shown = [line.strip() for line in block.group(1).splitlines() if line.strip()]
    assert shown == [f"{install_command(py)}   # Python {py[0]}.{py[1]}" for py in INSTALL_PYTHONS]


def test_the_quick_start_names_the_torch_it_expects():
    text = " ".join(quick_start().split())
    assert "your cluster's own is kept" in text
    assert "python -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "2.13.0" in (ROOT / "setup.py").read_text()  # the build setup.py's comment names for CPU machines


def test_version_messages_name_the_command_of_this_python():
    absent = ModuleNotFoundError("No module named 'megatron.training'", name="megatron.training")
    message = training_import_error("arguments", absent)
    assert core_install_command() in message and "0.20.0" not in message
    source = (ROOT / "megatron_wlb" / "megatron" / "args" / "version.py").read_text()
    assert source.count("core_install_command()") >= 2 and "pip install --no-deps megatron-core" not in source


def test_transformers_comes_with_the_megatron_extra():
    assert "transformers" in megatron_extra()


BLOCK_TRANSFORMERS = "import sys; sys.modules['transformers'] = None\n"


def test_analyze_sft_jsonl_without_transformers_says_what_to_install(tmp_path):
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    code = BLOCK_TRANSFORMERS + "from megatron_wlb.cli.main import main; sys.exit(main(sys.argv[1:]))"
    res = subprocess.run([sys.executable, "-c", code, "analyze", "--sft-jsonl", str(jsonl), "--sft-tokenizer",
                          str(tmp_path), "--config", "8b_sft_32k", "--out", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "pip install 'transformers'" in lines[0] and "internal error" not in lines[0], lines


def test_sft_training_without_transformers_is_refused_at_start_up(monkeypatch):
    from test_cli_launch import megatron_flags_parser

    from megatron_wlb.megatron.args import validation

    args, _ = megatron_flags_parser().parse_known_args(["--seq-length", "1024", "--micro-batch-size", "1",
                                                        "--data-path", "chat.jsonl"])
    args.data_parallel_size, args.variable_seq_lengths = 1, False
    args.sft, args.tokenizer_type = True, "SFTTokenizer"
    monkeypatch.setattr(validation, "module_available", lambda name: name != "transformers")
    with pytest.raises(ValueError) as err:
        validation.validate_wlb_args(args, te_available=False, highspy_available=True, check_files=False)
    assert "--sft (Megatron's SFTTokenizer) needs the Python package 'transformers'" in str(err.value)
    assert "pip install 'transformers'" in str(err.value)


def test_a_corpus_under_one_iteration_is_refused_naming_the_config_that_fits(tmp_path):
    """7b_128k's iteration is 524,288 tokens; a 100,000-token corpus is refused naming 550m_8k (32,768 tokens an
    iteration, the quick start's small config)."""
    assert load_config("7b_128k").packing.tokens_per_iteration == 524_288  # the quick start's figures
    assert load_config("550m_8k").packing.tokens_per_iteration == 32_768
    assert "524,288 tokens" in README and "`--config 550m_8k`: 32,768" in README
    lengths = tmp_path / "lengths.txt"
    np.savetxt(lengths, np.full(100, 1000), fmt="%d")
    wlb = [sys.executable, "-m", "megatron_wlb", "analyze", "--lengths", str(lengths), "--shuffles", "1"]
    res = subprocess.run([*wlb, "--config", "7b_128k", "--out", str(tmp_path / "a")], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "100,000 tokens, less than one iteration of 7b_128k" in res.stderr
    assert "--config 550m_8k (32,768 tokens an iteration)" in res.stderr  # which analyzes a small corpus:
    # tests/test_readme_quick_start.py runs the quick start's `wlb analyze ... --config 550m_8k`
