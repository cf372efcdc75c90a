"""`python -m grpo_engine.config > docs/configuration.md`."""

from .docs import config_docs_markdown

print(config_docs_markdown(), end="")
