"""lm-evaluation-harness, unchanged, against a running mesh: a log-likelihood task and a
`generate_until` task through `local-completions` (token-id prompts, `--batch_size 4`), and the
`generate_until` task through `local-chat-completions`, on tasks read from local files. The
log-likelihoods lm-eval gets from kvmesh are the ones it gets from transformers (its `hf` model)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from local_mesh import Mesh

pytest.importorskip("lm_eval")

QUESTIONS = [
    ("The river runs past the", [" stone", " garden", " cloud"], 0),
    ("North of the garden there is a", [" river", " light", " hill"], 1),
    ("Alpha beta gamma", [" delta", " north", " stone"], 0),
    ("Over the hills and far", [" away", " river", " light"], 0),
    ("A cloud over the", [" garden", " stone", " north"], 2),
]

CHOICE_TASK = """task: kvmesh_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""

GENERATE_TASK = """task: kvmesh_generate
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["."]
  max_gen_toks: 8
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


@pytest.fixture(scope="module")
def mesh(model_dir):
    m = Mesh(model_dir, workers=1)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-tasks")
    data = folder / "questions.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "kvmesh_choice.yaml").write_text(CHOICE_TASK.format(data=data))
    (folder / "kvmesh_generate.yaml").write_text(GENERATE_TASK.format(data=data))
    return folder


class LMEval:
    """The lm_eval CLI, run offline in a process of its own (several may run at once)."""

    def __init__(self, tasks: Path, out: Path, model: str, model_args: str, *task_names: str, extra=()):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_DATASETS_CACHE": str(out / "datasets"), "TOKENIZERS_PARALLELISM": "false"}
        command = [sys.executable, "-m", "lm_eval", "run", "--model", model, "--model_args", model_args,
                   "--tasks", *task_names, "--include_path", str(tasks), "--output_path", str(out), "--log_samples",
                   *extra]
        self.out, self.task_names = out, task_names
        out.mkdir(parents=True, exist_ok=True)
        self.log = out / "lm_eval.log"  # a file, not a pipe: a run's output never waits for another to be read
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def samples(self) -> dict:
        """{task: [sample records]} from its --log_samples files, once it has ended well."""
        self.process.wait(timeout=900)
        assert self.process.returncode == 0, self.log.read_text()[-9000:]
        samples = {}
        for name in self.task_names:
            [path] = list(self.out.rglob(f"samples_{name}_*.jsonl"))
            samples[name] = [json.loads(line) for line in path.read_text().splitlines()]
        return samples


def loglikelihoods(records: list[dict]) -> dict[tuple[int, int], float]:
    return {(r["doc_id"], i): float(resp[0][0]) for r in records for i, resp in enumerate(r["resps"])}


def test_lm_eval_runs_against_the_mesh_with_completions_and_chat(mesh, model_dir, tasks, tmp_path):
    base = f"http://{mesh.child('router').http}/v1"
    # The three runs at once (they are independent, and each is mostly its start-up).
    completions = LMEval(tasks, tmp_path / "completions", "local-completions",
                         f"model=default,base_url={base}/completions,tokenizer={model_dir},tokenizer_backend=huggingface,"
                         f"tokenized_requests=True,add_bos_token=True,num_concurrent=1,max_retries=1",
                         "kvmesh_choice", "kvmesh_generate", extra=["--batch_size", "4"])
    reference = LMEval(tasks, tmp_path / "hf", "hf", f"pretrained={model_dir},dtype=float32,add_bos_token=True",
                       "kvmesh_choice", "kvmesh_generate", extra=["--batch_size", "4", "--device", "cpu"])
    chat = LMEval(tasks, tmp_path / "chat", "local-chat-completions",
                  f"model=default,base_url={base}/chat/completions,tokenizer={model_dir},tokenizer_backend=huggingface,"
                  f"tokenized_requests=False,num_concurrent=1,max_retries=1",
                  "kvmesh_generate", extra=["--apply_chat_template"])
    completions, reference, chat = completions.samples(), reference.samples(), chat.samples()
    got, want = loglikelihoods(completions["kvmesh_choice"]), loglikelihoods(reference["kvmesh_choice"])
    assert len(got) == sum(len(c) for _, c, _ in QUESTIONS) and got.keys() == want.keys()
    assert all(abs(got[k] - want[k]) < 1e-3 for k in got), (got, want)
    generated = {r["doc_id"]: r["resps"][0][0] for r in completions["kvmesh_generate"]}
    assert generated == {r["doc_id"]: r["resps"][0][0] for r in reference["kvmesh_generate"]}  # greedy, same text
    assert len(chat["kvmesh_generate"]) == len(QUESTIONS)
    assert all(isinstance(r["resps"][0][0], str) for r in chat["kvmesh_generate"])
