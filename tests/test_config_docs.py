"""docs/configuration.md is generated from the config tree and must not drift from it."""

from pathlib import Path

from grpo_engine.config import config_docs_markdown, iter_config_docs

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_configuration_doc_is_in_sync():
    assert DOC.read_text() == config_docs_markdown(), (
        "docs/configuration.md is stale: run `python -m grpo_engine.config > docs/configuration.md`"
    )


def test_every_field_is_documented():
    undocumented = [name for name, _, _, help_text in iter_config_docs() if not help_text.strip()]
    assert undocumented == []


def test_tasks_doc_is_in_sync_and_every_option_documented():
    from grpo_engine.tasks import TASKS
    from grpo_engine.tasks.docs import generated_part, tasks_docs_markdown, with_generated_part

    doc = Path(__file__).resolve().parents[1] / "docs" / "tasks.md"
    assert generated_part(doc.read_text()) == tasks_docs_markdown(), \
        "docs/tasks.md is stale: python -m grpo_engine.tasks.docs"
    assert with_generated_part(doc.read_text()) == doc.read_text()
    import dataclasses

    undocumented = [f"{name}.{f.name}" for name, spec in TASKS.items() for f in dataclasses.fields(spec.options)
                    if not f.metadata.get("help")]
    assert undocumented == []
