import pytest

from conversion_runs import tiny_folders


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """Folders of a tiny Llama, GPT-2 and BERT (+ tokenizer) and calibration/eval text files."""
    return tiny_folders(tmp_path_factory.mktemp("tiny"))
