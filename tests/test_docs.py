"""The README documents every flag, metric and phase as the code defines them."""
import sys
from pathlib import Path

from proxy.config import OPTIONS
from proxy.meters import INSTRUMENTS
from proxy.metrics import METRICS
from proxy.timing import OUTCOMES, PHASES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "scripts"))
import readme_tables  # noqa: E402


def test_readme_tables_are_the_generated_ones():
    assert readme_tables.render(README) == README, "run: .venv/bin/python scripts/readme_tables.py"


def test_every_flag_and_env_var_is_documented():
    for option in OPTIONS:
        assert f"| `{option.flag}` | `{option.env}` | `{option.default!r}` | {option.help} |" in README, option.name


def test_every_metric_is_documented_with_its_definition():
    for d in METRICS:
        assert f"| `{d.exposed}` | {d.kind} | {', '.join(d.labels)} | {d.doc} |" in README, d.name


def test_every_otlp_instrument_is_documented_with_its_definition():
    for d in INSTRUMENTS:
        assert f"| `{d.name}` | {d.kind} | `{d.unit}` | {d.doc} |" in README, d.name


def test_phase_and_outcome_names_match():
    for phase in PHASES:
        assert f"`{phase}`" in README
    for outcome in OUTCOMES:
        assert outcome in README


def test_definitions_are_quoted_exactly():
    for line in (
        "- `ttft` = first content chunk of any choice read by the proxy − the request's first byte read by",
        "  - `proxy` — the proxy's own time: body read → upstream request issued, plus the first content",
        "- **Each choice is its own sequence** (`n > 1`). Per choice: its *decode tokens* are the tokens in",
        "- `decode` (`decode_s`) = last content chunk − first content chunk.",
        "  reasoning streamed): the phase `reasoning` = hidden tokens ÷ the request's own measured decode",
        "- **Prompt caching**: `prefill_tokens_per_second` = *uncached* prompt tokens ÷ the `prefill` phase;",
        "  - `client` — request received → request body fully read: the client's own upload, not the proxy;",
        "- **The latency histograms describe successful requests** (`outcome=\"ok\"`): duration, TTFT, ITL,",
    ):
        assert line in README
