"""Run lm-evaluation-harness tasks on a ParallelLM: the task folders, their data files, the errors, the results.

- Task folders. The tasks shipped with the project (evaluation/tasks/) and any ``--include-path``. lm-eval resolves a
  task's ``dataset_kwargs.data_files`` against the working directory, not the YAML's folder; here every folder is
  copied to a temporary one with each relative data file made absolute against its own YAML's folder (``!function``
  tags and ``include:`` keep working), so a task runs from any directory. A data file that does not exist is an
  error naming it and its task, before lm-eval starts.
- Task names. Looked up in those folders first (fast); lm-eval's own tasks (lambada_openai, hellaswag, ...) are
  indexed only when a name is not there (about 20 s). An unknown name is an error listing the tasks available.
- Offline. HF_DATASETS_OFFLINE and HF_HUB_OFFLINE are set unless the caller set them: lm-eval's standard tasks run
  from a prepared datasets cache (docs/evaluation.md says how to fill one).
- Results. lm-eval's result dictionary, on the rank whose LOCAL_RANK is 0 (lm-eval's rule; the others get None).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

SHIPPED_TASKS = Path(__file__).resolve().parent / "tasks"


class TaskError(ValueError):
    """A task that cannot run: unknown, or its data file missing."""


def offline() -> None:
    for name in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"):
        os.environ.setdefault(name, "1")


# -- task folders with absolute data files ---------------------------------------------------------------------------

class _Tagged:
    """A YAML scalar with an application tag (lm-eval's ``!function``), written back as it was."""

    def __init__(self, tag: str, value: str) -> None:
        self.tag, self.value = tag, value


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


_Loader.add_multi_constructor("!", lambda loader, suffix, node: _Tagged(node.tag, loader.construct_scalar(node)))
_Dumper.add_representer(_Tagged, lambda dumper, data: dumper.represent_scalar(data.tag, data.value))


def _absolute(files: Any, folder: Path, yaml_path: Path, task: str) -> Any:
    """data_files (a path, a list, or {split: either}) with relative paths made absolute; each must exist."""
    if isinstance(files, dict):
        return {split: _absolute(value, folder, yaml_path, task) for split, value in files.items()}
    if isinstance(files, list):
        return [_absolute(value, folder, yaml_path, task) for value in files]
    path = Path(str(files)).expanduser()
    path = path if path.is_absolute() else (folder / path).resolve()
    if not path.exists():
        raise TaskError(f"task {task} ({yaml_path}): its data file {path} does not exist")
    return str(path)


def _rewrite(yaml_path: Path, source: Path, copy: Path) -> None:
    config = yaml.load(yaml_path.read_text(), Loader=_Loader)
    files = config.get("dataset_kwargs", {}).get("data_files") if isinstance(config, dict) else None
    if files is None:
        return
    task = config.get("task", yaml_path.stem)
    config["dataset_kwargs"]["data_files"] = _absolute(files, yaml_path.parent, yaml_path, task)
    target = copy / yaml_path.relative_to(source)
    target.write_text(yaml.dump(config, Dumper=_Dumper, sort_keys=False, allow_unicode=True))


@contextmanager
def resolved_task_folders(folders: list[Path]) -> Iterator[list[Path]]:
    """Copies of ``folders`` whose YAMLs name their data files by absolute paths (module docstring)."""
    with tempfile.TemporaryDirectory(prefix="mtnlg-tasks-") as scratch:
        copies = []
        for number, folder in enumerate(folders):
            folder = Path(folder).resolve()
            if not folder.is_dir():
                raise TaskError(f"--include-path {folder} is not a directory of task YAMLs")
            copy = Path(scratch) / f"{number}-{folder.name}"
            shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("__pycache__"))
            for yaml_path in sorted(folder.rglob("*.yaml")):
                _rewrite(yaml_path, folder, copy)
            copies.append(copy)
        yield copies


# -- names -----------------------------------------------------------------------------------------------------------

def task_manager(tasks: list[str], folders: list[Path]):
    """A TaskManager that knows ``tasks``: the folders alone when they hold them all, else lm-eval's own too."""
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=[str(f) for f in folders], include_defaults=False)
    if not set(tasks) - set(manager.all_tasks):
        return manager
    everything = TaskManager(include_path=[str(f) for f in folders], include_defaults=True)
    unknown = sorted(set(tasks) - set(everything.all_tasks))
    if unknown:
        ours = ", ".join(manager.all_subtasks) or "none"
        raise TaskError(f"unknown task(s) {', '.join(unknown)}: the tasks in the task folders are {ours}; lm-eval "
                        f"has {len(everything.all_tasks) - len(manager.all_tasks):,} more (lm_eval --tasks list), "
                        f"which need their datasets in the local cache (docs/evaluation.md)")
    return everything


OFFLINE_HELP = ("run it once where the Hub is reachable, with HF_DATASETS_OFFLINE and HF_HUB_OFFLINE unset, to fill "
                "~/.cache/huggingface/datasets (or copy a filled cache here), or write it as a local json task as "
                "evaluation/tasks/ does (docs/evaluation.md)")


def _unavailable(task: str, error: Exception) -> TaskError:
    """One line for a task whose dataset is neither in the local cache nor reachable."""
    quoted = re.search(r"'([\w.-]+/[\w.-]+)'", str(error))  # the Hub's dataset id: owner/name
    dataset = f"dataset {quoted.group(1)}" if quoted else "its dataset"
    return TaskError(f"task {task}: {dataset} is not in the local datasets cache and the Hub cannot be reached "
                     f"({type(error).__name__}): {OFFLINE_HELP}")


@contextmanager
def _task_manager(tasks: list[str], include_paths: list[Path]) -> Iterator[Any]:
    """lm-eval offline and quiet, the shipped tasks and ``include_paths`` resolved: a TaskManager that knows
    ``tasks``, for the block."""
    offline()
    quiet_lm_eval()
    if not tasks:
        raise TaskError("no tasks given: pass --tasks, e.g. alice_lastword,alice_choice,alice_pages")
    with resolved_task_folders([SHIPPED_TASKS, *map(Path, include_paths)]) as folders:
        yield task_manager(tasks, folders)


def load_tasks(tasks: list[str], include_paths: list[Path] = ()) -> None:
    """Load each task's dataset once (from the cache), so that a task that cannot run is a TaskError naming it and
    its dataset before a model is loaded."""
    from datasets.exceptions import DatasetNotFoundError

    with _task_manager(tasks, include_paths) as manager:
        for task in tasks:
            try:
                manager.load([task])
            except (ConnectionError, DatasetNotFoundError) as error:  # the Hub's offline and not-found errors
                raise _unavailable(task, error) from None


def quiet_lm_eval(level: int = logging.WARNING) -> None:
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(level)


@functools.cache
def _environment() -> dict[str, Any]:
    from lm_eval.loggers.utils import add_env_info

    storage: dict[str, Any] = {}
    add_env_info(storage)
    return storage


def _environment_once(storage: dict[str, Any]) -> None:
    """lm-eval's add_env_info, collected once per process: it runs torch's collect_env (``pip list`` and other
    subprocesses, 0.76 s here) in every simple_evaluate, so a run evaluating its tasks every few hundred steps paid it
    at each evaluation."""
    storage.update(copy.deepcopy(_environment()))


def evaluate(lm, tasks: list[str], include_paths: list[Path] = (), num_fewshot: int | None = None,
             limit: int | float | None = None, log_samples: bool = False, bootstrap_iters: int = 0,
             seed: int = 1234) -> dict[str, Any] | None:
    """lm-eval's simple_evaluate of ``tasks`` on ``lm`` (a ParallelLM), the shipped tasks and ``include_paths``
    available. Every rank must call it; lm-eval's results come back where LOCAL_RANK is 0."""
    import lm_eval.evaluator
    from lm_eval import simple_evaluate

    lm_eval.evaluator.add_env_info = _environment_once  # the name simple_evaluate calls
    with _task_manager(tasks, include_paths) as manager:
        return simple_evaluate(model=lm, tasks=list(tasks), num_fewshot=num_fewshot, limit=limit,
                               log_samples=log_samples, bootstrap_iters=bootstrap_iters, task_manager=manager,
                               random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                               fewshot_random_seed=seed)


def metric_values(results: dict[str, Any]) -> dict[str, float]:
    """{"<task>/<metric>": value} of every numeric task metric (acc, acc_norm, perplexity, word_perplexity, ...),
    the filter suffix (",none") dropped, standard errors left out."""
    values = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            name = key.split(",")[0]
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not name.endswith("_stderr") \
                    and name != "alias":
                values[f"{task}/{name}"] = float(value)
    return values
