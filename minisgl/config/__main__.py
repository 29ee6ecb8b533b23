"""`python -m minisgl.config`: the table of environment switches (the README's)."""

from minisgl.config.env import markdown

print(markdown(), end="")
