import os
import shutil

import pytest
import torch

# The cores shared among pytest-xdist's workers (PYTEST_XDIST_WORKER_COUNT): two workers each running two threads on
# two cores lose time to oversubscription. Subprocesses the tests start inherit OMP_NUM_THREADS.
THREADS_PER_WORKER = max(1, min(2, os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
torch.set_num_threads(THREADS_PER_WORKER)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS_PER_WORKER))


@pytest.fixture
def tiny_llama():
    """A 4-block random Llama (hidden 64) for fast model-level tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=128, max_position_embeddings=128,
    )
    return LlamaForCausalLM(config)


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """``mktemp`` for module-scoped fixtures, whose directories are removed once the module's tests are done:
    with ``tmp_path_retention_policy = "failed"`` (pyproject) the suite's disk use stays near one test's, which
    a CI machine with little free disk needs (checkpoints add up to gigabytes over the suite)."""
    made = []

    def mktemp(name: str):
        made.append(tmp_path_factory.mktemp(name))
        return made[-1]

    yield mktemp
    for directory in made:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_tokenizer():
    from qat_app.models import load_tokenizer

    return load_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, embedded_tokenizer):
    """A tiny random Llama saved with the embedded SmolLM2 tokenizer, loadable by name like a hub model."""
    from tests._tiny_models import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny_model"), embedded_tokenizer)


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory):
    """A small jsonl corpus of pseudo-English documents."""
    import json
    import random

    rng = random.Random(0)
    words = "the model learns scale history window max amax quantization token step data block layer".split()
    path = tmp_path_factory.mktemp("corpus") / "docs.jsonl"
    with open(path, "w") as f:
        for i in range(300):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(20, 80)))
            f.write(json.dumps({"text": f"Document {i}. {text}."}) + "\n")
    return path


# The files that take longest (seconds on a 2-core CPU, from `--durations`), run first: `make test` hands whole files
# to two workers (pytest-xdist, --dist loadfile) in collection order, so the long ones starting first end together.
LONGEST_FILES = ("test_engine_check.py", "test_gpu_validation.py", "test_study.py", "test_fsdp.py", "test_evaluate.py",
                 "test_bad_inputs.py", "test_benchmark_coverage.py", "test_kl_cache.py", "test_ddp.py",
                 "test_cadence.py", "test_alarms.py", "test_benchmark_records.py", "test_models.py",
                 "test_distill_training.py", "test_fallback.py", "test_fallback_remedies.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
