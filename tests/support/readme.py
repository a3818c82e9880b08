"""The README's sections and code blocks, as tests run them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_section(section: str) -> str:
    """The text under the README heading `section`, up to the next one."""
    return README.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]


def readme_block(section: str) -> str:
    """The first ```python block under the README heading `section`."""
    return re.search(r"```python\n(.*?)```", readme_section(section), re.S).group(1)
