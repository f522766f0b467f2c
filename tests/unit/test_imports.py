"""The package's layering, read from its import statements (ast): what each part may import.

    model/        the math, the mechanisms and the plain decoder: torch only (an exported folder ships it)
    config, init, quiet, catalogue, data/, checkpoint/, kernels/   no Megatron-facing or top layers
    megatron/     may use the above; never training/ or hf/
    hf/           the above and model/; its modeling files import neither Megatron nor training code
    training/, xla/, train.py   the top: everything below
"""

import ast
import os

import pytest

from fixtures import ROOT

PACKAGE = os.path.join(ROOT, "mega_depth")


def imports_of(path):
    """Every module a file imports (absolute names; relative imports resolved against its package)."""
    rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
    package = rel.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.append(".".join(base + ([node.module] if node.module else [])))
            else:
                out.append(node.module)
    return out


def files(*parts):
    root = os.path.join(PACKAGE, *parts)
    if root.endswith(".py"):
        return [root]
    return [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".py")]


LOW = files("config.py") + files("init.py") + files("quiet.py") + files("catalogue.py") + files("data") + \
    files("checkpoint") + files("kernels")


def bad(paths, forbidden):
    return sorted({(os.path.relpath(p, ROOT), m) for p in paths for m in imports_of(p)
                   if any(m == f or m.startswith(f + ".") for f in forbidden)})


def test_the_model_folder_imports_only_itself_and_torch():
    for path in files("model"):
        for module in imports_of(path):
            assert not module.startswith("megatron"), (path, module)
            if module.startswith("mega_depth"):
                assert module.startswith("mega_depth.model"), (path, module)


def test_nothing_low_imports_megatron_training_or_hf():
    assert bad(LOW, ["mega_depth.megatron", "mega_depth.training", "mega_depth.hf", "mega_depth.xla",
                     "mega_depth.train"]) == []


def test_megatron_does_not_import_the_trainer_or_hf():
    assert bad(files("megatron"), ["mega_depth.training", "mega_depth.hf", "mega_depth.xla", "mega_depth.train"]) \
        == []


def test_hf_does_not_import_megatron_or_training():
    assert bad(files("hf"), ["megatron", "mega_depth.megatron", "mega_depth.training", "mega_depth.xla",
                             "mega_depth.train"]) == []


@pytest.mark.parametrize("name", ["configuration_mega_depth.py", "modeling_mega_depth.py"])
def test_hf_modeling_files_import_only_transformers_torch_and_the_model(name):
    shipped = {f[:-3] for f in os.listdir(os.path.join(PACKAGE, "model")) if f.endswith(".py")}
    shipped.add("configuration_mega_depth")  # in an exported folder these files sit beside this one
    for module in imports_of(os.path.join(PACKAGE, "hf", name)):
        sibling = module.startswith("mega_depth.hf.") and module.rsplit(".", 1)[1] in shipped
        assert module.split(".")[0] in ("torch", "transformers") or module.startswith("mega_depth.model") or \
            sibling, (name, module)


def test_the_cpu_patch_is_applied_by_entry_points_not_by_imports():
    """cpu_compat.apply() runs where Megatron starts (the backends, tests' fixtures), never at import time."""
    for path in files(""):
        tree = ast.parse(open(path).read())
        for node in tree.body:  # module level only
            calls = [n for n in ast.walk(node) if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "apply"
                     and getattr(getattr(n.func, "value", None), "id", "") == "cpu_compat"]
            assert not (calls and not isinstance(node, (ast.FunctionDef, ast.ClassDef))), path
