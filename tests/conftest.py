import importlib.util

import pytest

from fixtures import CORPUS, run

# tests/xla needs torch-xla (tools/test_xla.sh builds its environment); the main suite leaves it alone.
# tests/kernels runs in its own process (tests/unit/test_kernels.py), with the Triton interpreter switched on.
collect_ignore = ([] if importlib.util.find_spec("torch_xla") else ["xla"]) + ["kernels"]


@pytest.fixture(scope="session")
def data(tmp_path_factory):
    """A 1000-piece tokenizer trained on the embedded corpus, and the corpus preprocessed with it."""
    d = tmp_path_factory.mktemp("data")
    run(["tools/train_tokenizer.py", "--input", CORPUS, "--vocab-size", "1000", "--output-prefix", str(d / "spm")])
    run(["tools/preprocess_data.py", "--input", CORPUS, "--output-prefix", str(d / "docs"), "--tokenizer-model",
         str(d / "spm.model"), "--workers", "2", "--append-eod"])
    return {"dir": d, "flags": ["--data-path", str(d / "docs"), "--tokenizer-model", str(d / "spm.model"),
                                "--split", "90,10,0"]}
