"""Old option names that keep working for a while: a command rewrites each to its new name and says so in one line.

The old names are not declared as options, so --help shows only the new ones; nothing else of the command changes.
"""

from __future__ import annotations

import click


class RenamingCommand(click.Command):
    """A click command that accepts the old names of its renamed options.

    `renamed`: old name -> its new form: "--model" -> "--preset", or a flag that became an option with a value,
    "--client-mode" -> "--reachability client". `positional`: the option that took over a positional argument of
    old (`ttt inspect DATASET` -> `--dataset DATASET`): a bare word beyond the command's own arguments goes to it.
    """

    def __init__(self, *args, renamed: dict[str, str] | None = None, positional: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.renamed = renamed or {}
        self.positional = positional

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        return super().parse_args(ctx, self.rewrite(args))

    def rewrite(self, args: list[str]) -> list[str]:
        """ARGS with every old name in its new form (a notice on stderr for each)."""
        valued = {
            name
            for param in self.params
            if isinstance(param, click.Option) and not param.is_flag and not param.count
            for name in param.opts
        }
        words, rewritten, index = [], [], 0
        while index < len(args):
            token = args[index]
            if token == "--":
                rewritten.extend(args[index:])
                break
            name, equals, value = token.partition("=")
            index += 1
            if name in self.renamed:
                new = self.renamed[name].split()
                say_renamed(name, self.renamed[name])
                if len(new) > 1:  # a flag that became an option and its value
                    rewritten.extend(new)
                    continue
                token, name = new[0] + equals + value, new[0]
            rewritten.append(token)
            if token.startswith("-") and name in valued and not equals and index < len(args):
                rewritten.append(args[index])  # the option's value, even when it looks like a word
                index += 1
            elif not token.startswith("-"):
                words.append(len(rewritten) - 1)
        arguments = sum(1 for param in self.params if isinstance(param, click.Argument))
        if self.positional and len(words) > arguments:
            metavar = self.positional[2:].upper()
            say_renamed(f"{metavar} as a bare argument", f"{self.positional} {metavar}")
            rewritten.insert(words[0], self.positional)
        return rewritten


def say_renamed(old: str, new: str) -> None:
    click.echo(f"note: {old} is now {new}; the old form works for now and will go away", err=True)
