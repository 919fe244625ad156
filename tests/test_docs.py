"""The README is a first read that points into the reference (docs/), and the reference documents
every flag, metric, instrument and phase as the code defines them."""
import re
import sys
from pathlib import Path

from proxy.config import OPTIONS
from proxy.measure.meters import INSTRUMENTS
from proxy.measure.metrics import METRICS
from proxy.errors import OUTCOMES
from proxy.measure.timing import PHASES

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
PAGE = {path.name: path.read_text() for path in DOCS.glob("*.md")}
sys.path.insert(0, str(ROOT / "scripts"))
import doc_tables  # noqa: E402


def test_the_generated_tables_are_current():
    for page in doc_tables.PAGES:
        assert doc_tables.render(page.read_text()) == page.read_text(), f"run: .venv/bin/python scripts/doc_tables.py ({page.name})"


def test_every_flag_and_env_var_is_documented():
    for option in OPTIONS:
        assert f"| `{option.flag}` | `{option.env}` | `{option.default!r}` | {option.help} |" in PAGE["configuration.md"], option.name


def test_every_metric_and_otlp_instrument_is_documented_with_its_definition():
    for d in METRICS:
        assert f"| `{d.exposed}` | {d.kind} | {', '.join(d.labels)} | {d.doc} |" in PAGE["metrics.md"], d.name
    for d in INSTRUMENTS:
        assert f"| `{d.name}` | {d.kind} | `{d.unit}` | {d.doc} |" in PAGE["metrics.md"], d.name


def test_phase_and_outcome_names_match():
    for phase in PHASES:  # in the definitions, and in the README's table of the split
        assert f"`{phase}`" in PAGE["definitions.md"] and f"`{phase}`" in README, phase
    for outcome in OUTCOMES:
        assert f"`{outcome}`" in PAGE["relay.md"], outcome


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
        assert line in PAGE["definitions.md"], line


def test_the_readme_is_a_first_read_that_points_into_every_page():
    assert len(README.splitlines()) <= 300
    for client in ("`openai`", "`openai.AzureOpenAI`", "`anthropic`", "Claude Code", "Codex CLI", "`google-genai`", "Gemini CLI", "`ollama`"):
        assert f"| {client} |" in README, client
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", README))
    assert linked == set(PAGE), set(PAGE) ^ linked  # every page linked from it, and only pages that exist
    assert "make demo" in README and "make test" in README and "objectives:" in README


def test_every_relative_link_in_the_reference_resolves():
    for name, text in {**PAGE, "README.md": README}.items():
        base = ROOT if name == "README.md" else DOCS
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (base / target).resolve().exists(), (name, target)
