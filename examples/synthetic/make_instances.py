"""Build the synthetic SWE-bench instances (swebench 5.x format) used by tests and local demos.

Two tiny repositories of the project's own (evalplane/calc, evalplane/textkit), five instances, made to
behave like real ones: each repository has a history with release tags, every instance's base commit
has later commits after it (its own real fix among them, as upstream), and tags before and after it.
evalplane/textkit takes its version from its git tags (setuptools_scm, as pytest, astropy and xarray
do) and its tests refuse to run on an untagged build, so a checkout pruned of every tag is caught.
Every commit, tag and date is fixed, so re-running gives byte-identical outputs.

FAIL_TO_PASS / PASS_TO_PASS are DERIVED the way SWE-bench validation does it: run the instance's
test files with the test patch applied, before and after the gold patch, and parse both logs with
swebench's PARSER_REGISTRY["parse_log_pytest"].

Outputs (default: this script's folder):
  instances.jsonl                     one dataset row per instance
  repos/<owner>__<name>.bundle        a git bundle of each repository's whole history (branch and tags)
  repos/environments.toml             how to build each (repo, version)'s test environment
                                      (eval_worker.environments: instance images and process grading)
  demo_policy.json                    the provider simulator's demo policy (gold / wrong / empty)

Usage:
  python examples/synthetic/make_instances.py [--out DIR]
  python examples/synthetic/make_instances.py --check     # regenerate in a temp dir, diff with committed
"""

from __future__ import annotations

import argparse
import filecmp
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

HEREDOC_DELIMITER = "EOF_114329324912"  # the delimiter every official eval_script uses
START = ">>>>> Start Test Output"
END = ">>>>> End Test Output"
INSTALL = "python -m pip install -e ."  # what the official pytest-dev, xarray, ... eval scripts run

IDENTITY = {
    "GIT_AUTHOR_NAME": "evalplane",
    "GIT_AUTHOR_EMAIL": "synthetic@evalplane.invalid",
    "GIT_COMMITTER_NAME": "evalplane",
    "GIT_COMMITTER_EMAIL": "synthetic@evalplane.invalid",
}

# The test environment of every synthetic (repo, version): Python 3.9 or newer (the instance images use
# bullseye's 3.9), pytest 8.4 (the last series that supports 3.9), every requirement pinned. `build` holds
# what `pip install -e .` needs offline besides the environment itself (the build backends).
ENV_PYTHON = ">=3.9"
ENV_PACKAGES = [
    "pip==25.2", "setuptools==80.9.0", "pytest==8.4.2", "pluggy==1.6.0", "iniconfig==2.1.0", "packaging==25.0",
    "pygments==2.19.2", "exceptiongroup==1.3.0", "tomli==2.2.1", "typing_extensions==4.15.0",
]
ENV_BUILD = ["setuptools_scm==8.3.1", "importlib_metadata==8.7.0", "zipp==3.23.0"]

# ------------------------------------------------------------------------------------------ repos

_GITIGNORE = "__pycache__/\n*.pyc\n.pytest_cache/\n*.egg-info/\nbuild/\n"

CALC_FILES = {
    "README.md": "# calc\n\nSmall numeric helpers: clamping and basic descriptive statistics.\n",
    ".gitignore": _GITIGNORE,
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "calc"
version = "0.1.0"
description = "Small numeric helpers"
requires-python = ">=3.9"

[tool.setuptools]
packages = ["calc"]

[tool.pytest.ini_options]
pythonpath = ["."]
testpaths = ["tests"]
""",
    "calc/__init__.py": '''\
"""calc: small numeric helpers."""

from calc.ops import clamp, lerp
from calc.stats import mean, median

__all__ = ["clamp", "lerp", "mean", "median"]
__version__ = "0.1.0"
''',
    "calc/ops.py": '''\
"""Scalar operations."""


def clamp(value, low, high):
    """Limit value to the closed interval [low, high]."""
    if low > high:
        raise ValueError("low must not exceed high")
    if value < low:
        return low
    if value > high:
        return high
    return value


def lerp(start, end, t):
    """Linear interpolation between start and end for t in [0, 1]."""
    return start + (end - start) * t
''',
    "calc/stats.py": '''\
"""Descriptive statistics over sequences of numbers."""


def mean(values):
    """Arithmetic mean of a non-empty sequence of numbers."""
    values = list(values)
    return sum(values) / len(values)


def median(values):
    """Median of a non-empty sequence of numbers."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median requires at least one data point")
    mid = len(ordered) // 2
    return ordered[mid]
''',
    "tests/test_ops.py": '''\
import pytest

from calc import clamp, lerp


def test_clamp_inside():
    assert clamp(5, 0, 10) == 5


def test_clamp_low():
    assert clamp(-3, 0, 10) == 0


def test_clamp_high():
    assert clamp(42, 0, 10) == 10


def test_clamp_bad_bounds():
    with pytest.raises(ValueError):
        clamp(1, 10, 0)


@pytest.mark.parametrize("t,expected", [(0, 2.0), (0.5, 3.0), (1, 4.0)])
def test_lerp(t, expected):
    assert lerp(2.0, 4.0, t) == expected
''',
    "tests/test_stats.py": '''\
import pytest

from calc import mean, median


def test_mean_integers():
    assert mean([1, 2, 3, 4]) == 2.5


def test_mean_accepts_generator():
    assert mean(x for x in (2, 4, 6)) == 4


def test_median_odd():
    assert median([3, 1, 2]) == 2


def test_median_single():
    assert median([7]) == 7


def test_median_empty():
    with pytest.raises(ValueError):
        median([])
''',
}

TEXTKIT_FILES = {
    "README.md": "# textkit\n\nText utilities: slugs, truncation and word counts.\n",
    ".gitignore": _GITIGNORE + "textkit/_version.py\n",
    "pyproject.toml": """\
[build-system]
requires = ["setuptools>=64", "setuptools_scm>=8"]
build-backend = "setuptools.build_meta"

[project]
name = "textkit"
dynamic = ["version"]
description = "Text utilities"
requires-python = ">=3.9"

[tool.setuptools]
packages = ["textkit"]

[tool.setuptools_scm]
version_file = "textkit/_version.py"

[tool.pytest.ini_options]
testpaths = ["tests"]
""",
    "conftest.py": '''\
"""The tests run against an installed build whose version comes from the release tags (setuptools_scm)."""

import pytest
from packaging.version import Version

import textkit


def pytest_configure(config):
    if Version(textkit.__version__) < Version("1.0"):
        raise pytest.UsageError(
            f"textkit {textkit.__version__} is not a tagged build: install it with `pip install -e .` "
            "from a clone that has the release tags"
        )
''',
    "textkit/__init__.py": '''\
"""textkit: small text utilities."""

from textkit.slug import slugify
from textkit.wrap import truncate, word_count

try:  # written by setuptools_scm when the package is built or installed
    from textkit._version import version as __version__
except ImportError:
    __version__ = "0.0.0+unknown"

__all__ = ["slugify", "truncate", "word_count"]
''',
    "textkit/slug.py": '''\
"""URL slugs."""

import re
import unicodedata


def slugify(text, separator="-"):
    """Turn arbitrary text into a URL slug: lowercase ASCII words joined by separator."""
    normalized = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    lowered = normalized.lower()
    return re.sub(r"[^a-z0-9]", separator, lowered)
''',
    "textkit/wrap.py": '''\
"""Shortening and measuring text."""


def truncate(text, width, placeholder="..."):
    """Shorten text to at most width characters, marking the cut with placeholder."""
    if width < len(placeholder):
        raise ValueError("width is smaller than the placeholder")
    if len(text) <= width:
        return text
    return text[:width] + placeholder


def word_count(text):
    """Number of whitespace-separated words in text."""
    if not text:
        return 0
    return len(text.split(" "))
''',
    "tests/test_slug.py": '''\
from textkit import slugify


def test_slugify_single_word():
    assert slugify("hello") == "hello"


def test_slugify_two_words():
    assert slugify("Hello World") == "hello-world"


def test_slugify_accents():
    assert slugify("Cr\\u00e8me br\\u00fbl\\u00e9e") == "creme-brulee"


def test_slugify_separator():
    assert slugify("a b", separator="_") == "a_b"
''',
    "tests/test_wrap.py": '''\
import pytest

from textkit import truncate, word_count


def test_truncate_short_text_unchanged():
    assert truncate("abc", 10) == "abc"


def test_truncate_exact_width_unchanged():
    assert truncate("abcdef", 6) == "abcdef"


def test_truncate_width_too_small():
    with pytest.raises(ValueError):
        truncate("abcdef", 2)


def test_word_count_simple():
    assert word_count("one two three") == 3


def test_word_count_empty():
    assert word_count("") == 0
''',
}


@dataclass(frozen=True)
class Commit:
    message: str
    date: str
    files: dict[str, str] = field(default_factory=dict)  # whole files, written as given
    edits: tuple[tuple[str, str, str], ...] = ()  # (path, old, new); old occurs exactly once
    tag: str | None = None  # an annotated release tag on this commit


@dataclass(frozen=True)
class Base:
    """Instance <repo>-<number> starts here: its base commit is the commit before this marker."""

    number: int


@dataclass(frozen=True)
class Fix:
    """Instance <repo>-<number>'s real fix lands: its gold patch and test patch in one commit."""

    number: int
    message: str
    date: str
    tag: str | None = None


def _bump(path: str, old: str, new: str) -> tuple[str, str, str]:
    return (path, f'version = "{old}"' if path.endswith(".toml") else f'__version__ = "{old}"',
            f'version = "{new}"' if path.endswith(".toml") else f'__version__ = "{new}"')


def _calc_release(old: str, new: str) -> tuple[tuple[str, str, str], ...]:
    return (_bump("pyproject.toml", old, new), _bump("calc/__init__.py", old, new))


HISTORY: dict[str, list] = {
    "evalplane/calc": [
        Commit("calc: clamp, lerp, mean and median", "2025-11-03T10:00:00+00:00", files=CALC_FILES, tag="v0.1.0"),
        Commit("Release 0.2.0: usage in the README", "2025-12-15T09:30:00+00:00", tag="v0.2.0", edits=(
            ("README.md", "descriptive statistics.\n",
             ("descriptive statistics.\n\n```python\n>>> from calc import clamp, median\n>>> clamp(12, 0, 10)\n10\n"
             ">>> median([3, 1, 2])\n2\n```\n")),
            *_calc_release("0.1.0", "0.2.0"))),
        Base(1),
        Fix(1, "median: average the two middle values of even-length input (#1)", "2026-01-06T14:02:11+00:00"),
        Commit("Release 0.2.1", "2026-01-07T08:15:00+00:00", edits=_calc_release("0.2.0", "0.2.1"), tag="v0.2.1"),
        Base(2),
        Fix(2, "mean: raise ValueError for empty input (#2)", "2026-01-09T11:40:00+00:00"),
        Commit("Add variance", "2026-01-26T16:20:00+00:00", edits=(
            ("calc/stats.py", '\n\ndef median(values):\n',
             ('\n\ndef variance(values):\n    """Population variance of a non-empty sequence of numbers."""\n'
             "    values = list(values)\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / len(values)\n"
             '\n\ndef median(values):\n')),
            ("calc/__init__.py", "from calc.stats import mean, median\n",
             "from calc.stats import mean, median, variance\n"),
            ("calc/__init__.py", '"median"]', '"median", "variance"]'),
            ("tests/test_stats.py", "from calc import mean, median\n", "from calc import mean, median, variance\n"),
            ("tests/test_stats.py", "def test_median_odd():\n",
             "def test_variance():\n    assert variance([1, 2, 3, 4]) == 1.25\n\n\ndef test_median_odd():\n"),
        )),
        Commit("Release 0.3.0", "2026-02-02T10:00:00+00:00", edits=_calc_release("0.2.1", "0.3.0"), tag="v0.3.0"),
    ],
    "evalplane/textkit": [
        Commit("textkit: slugify, truncate and word_count", "2025-10-20T12:00:00+00:00", files=TEXTKIT_FILES,
               tag="v1.0.0"),
        Commit("Document the separator argument of slugify", "2025-12-20T10:45:00+00:00", tag="v1.1.0", edits=(
            ("textkit/slug.py", '    """Turn arbitrary text into a URL slug: lowercase ASCII words joined by separator."""\n',
             ('    """Turn arbitrary text into a URL slug: lowercase ASCII words joined by separator.\n\n'
             '    separator may be any string; "-" by default, "_" for identifiers.\n    """\n')),)),
        Base(1),
        Fix(1, "slugify: collapse runs of separators and strip them at the ends (#3)", "2026-01-13T09:00:00+00:00"),
        Base(2),
        Fix(2, "truncate: count the placeholder in the width (#4)", "2026-01-16T15:30:00+00:00", tag="v1.2.0"),
        Base(3),
        Fix(3, "word_count: split on any run of whitespace (#5)", "2026-01-20T10:10:00+00:00"),
        Commit("Add reading_time", "2026-02-03T13:00:00+00:00", tag="v1.3.0", edits=(
            ("textkit/wrap.py", "def word_count(text):\n",
             ('def reading_time(text, words_per_minute=200):\n    """Minutes needed to read text, rounded up."""\n'
             "    return -(-word_count(text) // words_per_minute)\n\n\ndef word_count(text):\n")),
            ("tests/test_wrap.py", "from textkit import truncate, word_count\n",
             "from textkit import truncate, word_count\nfrom textkit.wrap import reading_time\n"),
            ("tests/test_wrap.py", "def test_word_count_empty():\n",
             "def test_reading_time():\n    assert reading_time(\"word \" * 450) == 3\n\n\ndef test_word_count_empty():\n"),
        )),
    ],
}

# -------------------------------------------------------------------------------------- instances
# Each edit is (path, old, new): `old` must occur exactly once in the file at the instance's base.

INSTANCES: list[dict] = [
    {
        "repo": "evalplane/calc",
        "number": 1,
        "created_at": "2026-01-05T09:12:44Z",
        "problem_statement": """\
median() returns the wrong value for even-length input

For a sequence with an even number of elements, `calc.median` returns the upper of the two middle
values instead of their average:

```python
>>> from calc import median
>>> median([4, 1, 3, 2])
3
```

The median of `[1, 2, 3, 4]` is `2.5`. Odd-length input works fine. `statistics.median` from the
standard library returns `2.5` here, and we document `median` as a drop-in for it. I noticed this
when the dashboards showed a different median latency than our offline notebook.
""",
        "patch": [(
            "calc/stats.py",
            "    mid = len(ordered) // 2\n    return ordered[mid]\n",
            ("    mid = len(ordered) // 2\n    if len(ordered) % 2:\n        return ordered[mid]\n"
            "    return (ordered[mid - 1] + ordered[mid]) / 2\n"),
        )],
        "test_patch": [(
            "tests/test_stats.py",
            "def test_median_empty():\n",
            ("def test_median_even():\n    assert median([4, 1, 3, 2]) == 2.5\n\n\n"
            '@pytest.mark.parametrize("values,expected", [([1, 3], 2), ([1, 2, 3, 4, 5, 6], 3.5), ([5, 5], 5)])\n'
            "def test_median_even_param(values, expected):\n    assert median(values) == expected\n\n\n"
            "def test_median_empty():\n"),
        )],
    },
    {
        "repo": "evalplane/calc",
        "number": 2,
        "created_at": "2026-01-08T16:40:02Z",
        "problem_statement": """\
mean([]) raises ZeroDivisionError instead of a clear ValueError

Calling `calc.mean` on an empty sequence crashes with an unhelpful error:

```
>>> calc.mean([])
ZeroDivisionError: division by zero
```

`median([])` already raises `ValueError("median requires at least one data point")`, and the
standard library's `statistics.mean` raises `StatisticsError` (a `ValueError` subclass). Callers
that guard with `except ValueError` get a crash instead. `mean` should raise `ValueError` with a
message that says at least one data point is required. Generators must keep working.
""",
        "patch": [(
            "calc/stats.py",
            "    values = list(values)\n    return sum(values) / len(values)\n",
            ("    values = list(values)\n    if not values:\n"
            '        raise ValueError("mean requires at least one data point")\n'
            "    return sum(values) / len(values)\n"),
        )],
        "test_patch": [(
            "tests/test_stats.py",
            "def test_median_odd():\n",
            ("def test_mean_empty_raises_value_error():\n"
            '    with pytest.raises(ValueError, match="at least one data point"):\n        mean([])\n\n\n'
            "def test_mean_empty_generator():\n    with pytest.raises(ValueError):\n"
            "        mean(x for x in ())\n\n\n"
            "def test_median_odd():\n"),
        )],
    },
    {
        "repo": "evalplane/textkit",
        "number": 1,
        "created_at": "2026-01-12T11:03:27Z",
        "problem_statement": """\
slugify leaves repeated and trailing separators

`textkit.slugify` replaces every non-alphanumeric character with the separator one by one, so
punctuation next to spaces produces runs of dashes, and leading/trailing punctuation leaves
dashes at the ends:

```python
>>> slugify("Hello,  World!")
'hello---world-'
>>> slugify("  --Draft-- ")
'----draft----'
```

Expected `'hello-world'` and `'draft'`. A slug should never contain two separators in a row and
should never start or end with one; these slugs end up in URLs and look broken. Custom separators
(e.g. `_`) should behave the same way.
""",
        "patch": [(
            "textkit/slug.py",
            '    return re.sub(r"[^a-z0-9]", separator, lowered)\n',
            '    return re.sub(r"[^a-z0-9]+", separator, lowered).strip(separator)\n',
        )],
        "test_patch": [(
            "tests/test_slug.py",
            "def test_slugify_separator():\n",
            ("def test_slugify_collapses_punctuation():\n"
            '    assert slugify("Hello,  World!") == "hello-world"\n\n\n'
            "def test_slugify_strips_edges():\n"
            '    assert slugify("  --Draft-- ") == "draft"\n\n\n'
            "def test_slugify_custom_separator_collapses():\n"
            '    assert slugify("a -- b", separator="_") == "a_b"\n\n\n'
            "def test_slugify_separator():\n"),
        )],
    },
    {
        "repo": "evalplane/textkit",
        "number": 2,
        "created_at": "2026-01-15T08:27:51Z",
        "problem_statement": """\
truncate() returns strings longer than the requested width

The docstring of `textkit.truncate` promises "at most width characters", but when the text is
cut the placeholder is appended after cutting at `width`, so the result is
`width + len(placeholder)` characters long:

```python
>>> truncate("abcdefghij", 8)
'abcdefgh...'   # 11 characters
```

Expected `'abcde...'` (8 characters, placeholder included). This breaks our fixed-width table
rendering. Custom placeholders should be accounted for the same way, e.g.
`truncate("abcdefghij", 5, placeholder="~")` should give `'abcd~'`.
""",
        "patch": [(
            "textkit/wrap.py",
            "    return text[:width] + placeholder\n",
            "    return text[: width - len(placeholder)] + placeholder\n",
        )],
        "test_patch": [(
            "tests/test_wrap.py",
            "def test_word_count_simple():\n",
            ("def test_truncate_respects_width():\n"
            '    assert truncate("abcdefghij", 8) == "abcde..."\n\n\n'
            "def test_truncate_custom_placeholder():\n"
            '    assert truncate("abcdefghij", 5, placeholder="~") == "abcd~"\n\n\n'
            "def test_word_count_simple():\n"),
        )],
    },
    {
        "repo": "evalplane/textkit",
        "number": 3,
        "created_at": "2026-01-19T14:55:09Z",
        "problem_statement": """\
word_count miscounts text with repeated spaces, tabs or newlines

`textkit.word_count` is documented as counting whitespace-separated words, but it splits on a
single space only:

```python
>>> word_count("one  two")
3
>>> word_count("one\\ntwo\\tthree")
1
>>> word_count("   ")
4
```

Expected 2, 3 and 0. Any run of whitespace (spaces, tabs, newlines) should separate words, and
leading or trailing whitespace should not count as words. We use this to enforce length limits on
user comments, and multi-line comments are counted completely wrong.
""",
        "patch": [(
            "textkit/wrap.py",
            '    return len(text.split(" "))\n',
            "    return len(text.split())\n",
        )],
        "test_patch": [(
            "tests/test_wrap.py",
            "def test_word_count_empty():\n",
            ("def test_word_count_repeated_spaces():\n"
            '    assert word_count("one  two") == 2\n\n\n'
            "def test_word_count_newlines_and_tabs():\n"
            '    assert word_count("one\\ntwo\\tthree") == 3\n\n\n'
            "def test_word_count_only_whitespace():\n"
            '    assert word_count("   ") == 0\n\n\n'
            "def test_word_count_empty():\n"),
        )],
    },
]

# The provider simulator's demo model: gold everywhere, except one wrong fix and one empty patch.
WRONG_INSTANCE = "evalplane__calc-1"
WRONG_EDIT = [(
    "calc/stats.py",
    "    mid = len(ordered) // 2\n    return ordered[mid]\n",
    # plausible but wrong: averages the upper pair (and indexes past the end for 2 elements)
    ("    mid = len(ordered) // 2\n    if len(ordered) % 2 == 0:\n"
    "        return (ordered[mid] + ordered[mid + 1]) / 2\n    return ordered[mid]\n"),
)]
EMPTY_INSTANCE = "evalplane__textkit-2"

# -------------------------------------------------------------------------------------- helpers


def repo_slug(repo: str) -> str:
    return repo.replace("/", "__")


def instance_id(repo: str, number: int) -> str:
    return f"{repo_slug(repo)}-{number}"


def image_name(iid: str) -> str:
    """The official naming (swebench image_builder ImageSpec.name with namespace 'swebench')."""
    return f"swebench/sweb.eval.x86_64.{iid}:latest".replace("__", "_1776_").lower()


def _clean_env(home: Path) -> dict[str, str]:
    venv_bin = str(Path(sys.executable).parent)
    return {
        "PATH": venv_bin + os.pathsep + os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TMPDIR": str(home),
        "GIT_CONFIG_GLOBAL": str(home / "gitconfig"),
        "GIT_CONFIG_NOSYSTEM": "1",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        **IDENTITY,
    }


def _git(cwd: Path, env: dict, *args: str, date: str | None = None) -> str:
    if date:
        env = {**env, "GIT_AUTHOR_DATE": date, "GIT_COMMITTER_DATE": date}
    out = subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True)
    return out.stdout


def _apply_edits(root: Path, edits) -> None:
    for path, old, new in edits:
        f = root / path
        text = f.read_text()
        if text.count(old) != 1:
            raise SystemExit(f"edit anchor not unique in {path}: {old!r}")
        f.write_text(text.replace(old, new))


def _diff(root: Path, env: dict) -> str:
    """A unified git diff of the work tree, in the official dataset shape (no index lines)."""
    raw = _git(root, env, "diff", "--no-color", "--no-ext-diff", "--no-renames", "-U3")
    return "".join(line for line in raw.splitlines(keepends=True) if not line.startswith("index "))


def _edit_to_patch(root: Path, env: dict, edits) -> str:
    _apply_edits(root, edits)
    patch = _diff(root, env)
    _git(root, env, "checkout", "--", ".")
    return patch


def _modified_files(patch: str) -> list[str]:
    from swebench.utils import get_modified_files

    return get_modified_files(patch)


def make_eval_script(base_commit: str, test_patch: str) -> str:
    """The official v5 eval_script shape, line for line as in the SWE-bench_Verified pytest-dev rows."""
    test_files = " ".join(_modified_files(test_patch))
    delim = HEREDOC_DELIMITER
    if delim in test_patch:
        from swebench.utils import generate_heredoc_delimiter

        delim = generate_heredoc_delimiter(test_patch)
    lines = [
        "#!/bin/bash",
        "set -uxo pipefail",
        "source /opt/miniconda3/bin/activate",
        "conda activate testbed",
        "cd /testbed",
        "git config --global --add safe.directory /testbed",
        "cd /testbed",
        "git status",
        "git show",
        f"git -c core.fileMode=false diff {base_commit}",
        "source /opt/miniconda3/bin/activate",
        "conda activate testbed",
        INSTALL,
        f"git checkout {base_commit} {test_files}",
        f"git apply -v - <<'{delim}'\n{test_patch}\n{delim}",
        f": '{START}'",
        f"pytest -rA {test_files}",
        f": '{END}'",
        f"git checkout {base_commit} {test_files}",
    ]
    return "\n".join(lines) + "\n"


def scm_version(root: Path, env: dict) -> str:
    """The version setuptools_scm's default scheme gives a clean checkout: the tag itself on a tagged
    commit, else the next patch release as a dev build, e.g. 1.1.1.dev2+g1a2b3c4 (2 commits after v1.1.0)."""
    tag, distance, node = _git(root, env, "describe", "--tags", "--long", "--abbrev=7").strip().rsplit("-", 2)
    release = tag.lstrip("v")
    if distance == "0":
        return release
    major, minor, patch = (int(x) for x in release.split("."))
    return f"{major}.{minor}.{patch + 1}.dev{distance}+{node}"


def _run_tests(root: Path, env: dict, test_files: list[str]) -> dict[str, str]:
    # The package is imported from the work tree, and setuptools_scm's version file is written as an install
    # would: this derives test ids and statuses only; the eval worker's tests grade every gold patch in the
    # instance's own environment. Third-party pytest plugins are off (speed; same ids and statuses).
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", *test_files],
        cwd=root,
        env={**env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True, check=False
    )
    from swebench.harness.log_parsers import PARSER_REGISTRY

    return PARSER_REGISTRY["parse_log_pytest"](proc.stdout, None)


def _passed(status: str | None) -> bool:
    return status in ("PASSED", "XFAIL")


def _row(spec: dict, root: Path, env: dict) -> tuple[dict, str | None]:
    """The instance row at the current HEAD (its base commit); the work tree is left clean."""
    repo = spec["repo"]
    iid = instance_id(repo, spec["number"])
    base = _git(root, env, "rev-parse", "HEAD").strip()
    patch = _edit_to_patch(root, env, spec["patch"])
    test_patch = _edit_to_patch(root, env, spec["test_patch"])
    test_files = _modified_files(test_patch)
    # a setuptools_scm repository's version file, gitignored, as an install leaves it
    version_file = root / repo.split("/")[1] / "_version.py"
    if "setuptools_scm" in (root / "pyproject.toml").read_text():
        version_file.write_text(f'version = "{scm_version(root, env)}"\n')
    try:
        # SWE-bench validation: test patch applied, before and after the gold patch.
        _apply_edits(root, spec["test_patch"])
        before = _run_tests(root, env, test_files)
        _apply_edits(root, spec["patch"])
        after = _run_tests(root, env, test_files)
        _git(root, env, "checkout", "--", ".")
    finally:
        version_file.unlink(missing_ok=True)
    f2p = [t for t, s in after.items() if _passed(s) and not _passed(before.get(t))]
    p2p = [t for t, s in after.items() if _passed(s) and _passed(before.get(t))]
    broken = [t for t, s in after.items() if not _passed(s)]
    if not f2p or broken:
        raise SystemExit(f"{iid}: gold validation failed (F2P={f2p}, failing after gold={broken})")
    wrong = _edit_to_patch(root, env, WRONG_EDIT) if iid == WRONG_INSTANCE else None
    last_tag = _git(root, env, "describe", "--tags", "--abbrev=0").strip()
    return {
        "repo": repo,
        "instance_id": iid,
        "base_commit": base,
        "patch": patch,
        "test_patch": test_patch,
        "problem_statement": spec["problem_statement"],
        "hints_text": "",
        "created_at": spec["created_at"],
        "version": ".".join(last_tag.lstrip("v").split(".")[:2]),  # as upstream: major.minor of the release
        "FAIL_TO_PASS": json.dumps(f2p),
        "PASS_TO_PASS": json.dumps(p2p),
        "environment_setup_commit": "",  # set once every instance of the version is known
        "image": image_name(iid),
        "eval_script": make_eval_script(base, test_patch),
        "log_parser": "parse_log_pytest",
        "eval_type": "pass_and_fail",
    }, wrong


def build_repo(repo: str, root: Path, env: dict) -> tuple[list[dict], str | None]:
    """Make the repository's whole history in `root`; return its instances' rows (and the wrong patch)."""
    specs = {s["number"]: s for s in INSTANCES if s["repo"] == repo}
    rows, wrong = [], None
    _git(root, env, "init", "-q", "-b", "main")
    for step in HISTORY[repo]:
        if isinstance(step, Base):
            row, w = _row(specs[step.number], root, env)
            rows.append(row)
            wrong = wrong or w
            continue
        if isinstance(step, Fix):
            spec = specs[step.number]
            _apply_edits(root, spec["patch"] + spec["test_patch"])
            message, date, tag = step.message, step.date, step.tag
        else:
            for rel, content in sorted(step.files.items()):
                p = root / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(content)
            _apply_edits(root, step.edits)
            message, date, tag = step.message, step.date, step.tag
        _git(root, env, "add", "-A")
        _git(root, env, "commit", "-q", "-m", message, date=date)
        if tag:
            _git(root, env, "tag", "-a", tag, "-m", f"{repo.split('/')[1]} {tag.lstrip('v')}", date=date)
    if sorted(r["instance_id"] for r in rows) != sorted(instance_id(repo, n) for n in specs):
        raise SystemExit(f"{repo}: every instance needs exactly one Base marker in its history")
    return rows, wrong


def environments_toml(rows: list[dict]) -> str:
    """repos/environments.toml: one recipe per repository, for every version its instances have."""
    versions: dict[str, list[str]] = {}
    for r in rows:
        versions.setdefault(r["repo"], [])
        if r["version"] not in versions[r["repo"]]:
            versions[r["repo"]].append(r["version"])

    def toml_list(items: list[str]) -> str:
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    out = [
        "# How to build each (repo, version)'s test environment, the conda env `testbed` of its instance image.",
        "# Read by eval_worker.environments: images/swebench/build.py bakes it into the instance images, and the",
        "# process grading backend builds it once per recipe under the state dir. Generated by",
        "# examples/synthetic/make_instances.py.",
    ]
    for repo, vs in versions.items():
        out += [
            "",
            "[[environment]]",
            f"repo = {json.dumps(repo)}",
            f"versions = {toml_list(vs)}",
            f"python = {json.dumps(ENV_PYTHON)}",
            f"packages = {toml_list(ENV_PACKAGES)}",
            f"build = {toml_list(ENV_BUILD)}",
            f"install = {json.dumps(INSTALL)}",
        ]
    return "\n".join(out) + "\n"


def build(out: Path) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    (out / "repos").mkdir(exist_ok=True)
    rows: list[dict] = []
    wrong_patch = None
    with tempfile.TemporaryDirectory(prefix="ep-synth-") as tmp:
        tmp = Path(tmp)
        home = tmp / "home"
        home.mkdir()
        env = _clean_env(home)

        def one(repo: str) -> tuple[list[dict], str | None]:
            root = tmp / repo_slug(repo)
            root.mkdir()
            made = build_repo(repo, root, env)
            bundle = out / "repos" / f"{repo_slug(repo)}.bundle"
            bundle.unlink(missing_ok=True)
            _git(root, env, "-c", "pack.threads=1", "bundle", "create", "-q", str(bundle), "--all")
            return made

        _modified_files("")  # import swebench once, before the threads
        with ThreadPoolExecutor(max_workers=len(HISTORY)) as pool:
            for repo_rows, wrong in pool.map(one, HISTORY):
                rows += repo_rows
                wrong_patch = wrong_patch or wrong
    order = [instance_id(s["repo"], s["number"]) for s in INSTANCES]
    rows.sort(key=lambda r: order.index(r["instance_id"]))
    for r in rows:  # as upstream: one environment setup commit per (repo, version), its newest base
        r["environment_setup_commit"] = [x for x in rows if (x["repo"], x["version"]) == (r["repo"], r["version"])][
            -1]["base_commit"]

    with open(out / "instances.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    (out / "repos" / "environments.toml").write_text(environments_toml(rows))
    policy = {
        "default": {"action": "gold"},
        "instances": {
            WRONG_INSTANCE: {"action": "patch", "patch": wrong_patch},
            EMPTY_INSTANCE: {"action": "empty"},
        },
    }
    (out / "demo_policy.json").write_text(json.dumps(policy, indent=2, ensure_ascii=False) + "\n")
    return rows


OUTPUTS = ("instances.jsonl", "demo_policy.json", "repos/environments.toml") + tuple(
    f"repos/{repo_slug(r)}.bundle" for r in HISTORY
)


def check(committed: Path) -> list[str]:
    """Regenerate into a temp dir; return the outputs that differ from (or are missing in) `committed`."""
    with tempfile.TemporaryDirectory(prefix="ep-synth-check-") as tmp:
        build(Path(tmp))
        return [
            rel for rel in OUTPUTS
            if not (committed / rel).is_file()
            or not filecmp.cmp(Path(tmp) / rel, committed / rel, shallow=False)
        ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE, help="output folder (default: this script's folder)")
    ap.add_argument(
        "--check", action="store_true", help="regenerate into a temp dir and fail on any difference"
    )
    args = ap.parse_args(argv)
    if args.check:
        diff = check(args.out)
        if diff:
            print("synthetic instances are stale: " + ", ".join(diff), file=sys.stderr)
            return 1
        print("synthetic instances are up to date")
        return 0
    rows = build(args.out)
    for r in rows:
        print(f"{r['instance_id']}: version {r['version']} F2P={r['FAIL_TO_PASS']} "
              f"P2P={len(json.loads(r['PASS_TO_PASS']))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
