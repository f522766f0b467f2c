import importlib.util

import pytest

from fixtures import CORPUS, run

# tests/xla needs torch-xla (tools/test_xla.sh builds its environment); the main suite leaves it alone.
# tests/kernels runs in its own process (tests/unit/test_kernels.py), with the Triton interpreter switched on.
collect_ignore = ([] if importlib.util.find_spec("torch_xla") else ["xla"]) + ["kernels"]

# The longest files first: tools/test.sh hands the suite to two workers a file at a time, in this order
# (--no-loadscope-reorder), so a long file started last would run alone at the end. Minutes on 2 shared cores.
LONGEST_FIRST = [
    "integration/test_layouts.py",  # ~15: four launches, every layout
    "unit/test_kernels.py",  # ~9: the kernel tests under the Triton interpreter, in one process
    "e2e/test_launchers.py",  # ~8
    "e2e/test_tools.py",  # ~7
    "e2e/test_training.py",  # ~7
    "e2e/test_reliability.py",  # ~10
    "e2e/test_hf.py",  # ~8
    "e2e/test_backends.py",  # ~5
]


def pytest_collection_modifyitems(items):
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))  # stable


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A 1000-piece tokenizer trained on the embedded corpus, and the corpus preprocessed with it."""
    d = tmp_path_factory.mktemp("data")
    run(["tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", "1000", "--output-prefix", str(d / "spm")])
    run(["tools/preprocess_data.py", "--input", CORPUS, "--output-prefix", str(d / "docs"), "--tokenizer-model",
         str(d / "spm.model"), "--workers", "2", "--append-eod"])
    return {"dir": d, "flags": ["--data-path", str(d / "docs"), "--tokenizer-model", str(d / "spm.model"),
                                "--split", "90,10,0"]}
