"""InterventionLogger: TensorBoard records of a delta being trained.

Written through Lightning's :class:`~lightning.pytorch.loggers.TensorBoardLogger` (its ``SummaryWriter``), on rank
zero only:

- scalars every ``every_n_steps`` steps: ``loss/<term>`` for the total (``loss/total``) and each term (``nll``,
  ``towards``, ``away``, ``kl``, ``l2``), ``prob/<name>`` for the probabilities (``prob/target``,
  ``prob/towards``, ``prob/away``) and ``delta_norm/<node>@<position>`` per delta;
- histograms ``delta/<node>@<position>`` of each delta's values every ``histogram_every_n_steps`` steps and at the
  end;
- text ``generations``: a markdown table of each prompt with its greedy continuation before and after training;
- hparams: nodes, positions, objective terms and weights, lr, optimizer, steps (``describe()`` of the module plus
  the trainer's ``max_steps``), with the final ``hp/loss`` and probabilities as metrics.

Scalars are logged on the step index ``trainer.global_step`` of the step that computed them (0 for the first).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import TensorBoardLogger

from ..errors import RecipeConfigError

__all__ = ["InterventionLogger", "generations_table"]

_PROBABILITY_TAGS = {"p_target": "prob/target", "p_towards": "prob/towards", "p_away": "prob/away"}


class InterventionLogger(Callback):
    """Log loss terms, probabilities, delta norms and histograms, generations and hyperparameters to TensorBoard.

    Works with a :class:`~recipes.delta.module.DeltaModule` (or any module whose ``training_step`` returns
    ``{"loss", "terms"}`` and that has ``deltas``, ``delta_names()``; ``generate()``, ``generation_prompts()`` and
    ``describe()`` are used when present).

    Args:
        every_n_steps: write scalars every this many steps (1: every step).
        histogram_every_n_steps: write delta histograms every this many steps (and always at the end); 0 for the
            end only.
        max_new_tokens: tokens of each greedy generation.
        prompts: prompts to generate from; ``None`` for the module's ``generation_prompts()``.
        max_prompts: at most this many prompts are generated from.

    Raises:
        RecipeConfigError: (at fit start) the trainer has no TensorBoardLogger.
    """

    def __init__(self, every_n_steps: int = 1, histogram_every_n_steps: int = 10, max_new_tokens: int = 8,
                 prompts: list[str] | None = None, max_prompts: int = 8) -> None:
        super().__init__()
        if every_n_steps < 1:
            raise RecipeConfigError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self.histogram_every_n_steps = histogram_every_n_steps
        self.max_new_tokens = max_new_tokens
        self.prompts = prompts
        self.max_prompts = max_prompts
        self.before: list[str] = []
        self.after: list[str] = []
        self.last_terms: dict[str, float] = {}

    # --- helpers -------------------------------------------------------------------------------------------

    @staticmethod
    def tensorboard(trainer: Trainer) -> TensorBoardLogger:
        """The trainer's TensorBoardLogger.

        Raises:
            RecipeConfigError: there is none.
        """
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                return logger
        raise RecipeConfigError("InterventionLogger writes to TensorBoard: give the Trainer a logger, e.g. "
                                "Trainer(logger=TensorBoardLogger('runs')) or trainer.logger in the YAML config")

    def _prompts(self, module: LightningModule) -> list[str]:
        prompts = self.prompts if self.prompts is not None else getattr(module, "generation_prompts", list)()
        return list(prompts)[: self.max_prompts]

    def _generate(self, module: LightningModule) -> list[str]:
        prompts = self._prompts(module)
        if not prompts or not hasattr(module, "generate"):
            return []
        return module.generate(prompts, max_new_tokens=self.max_new_tokens)

    def _histograms(self, trainer: Trainer, module: LightningModule, step: int) -> None:
        writer = self.tensorboard(trainer).experiment
        for name, delta in zip(module.delta_names(), module.deltas):
            writer.add_histogram(f"delta/{name}", delta.detach().float().cpu(), step)

    # --- hooks ---------------------------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Check for a TensorBoardLogger before training starts."""
        self.tensorboard(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Greedy generations before training (rank zero)."""
        if trainer.is_global_zero:
            self.before = self._generate(pl_module)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        """Scalars (and histograms) of the step that just ran (rank zero)."""
        if not trainer.is_global_zero or not isinstance(outputs, dict) or "terms" not in outputs:
            return
        step = trainer.global_step - 1  # global_step counts optimizer steps taken, this one included
        terms = {name: float(value) for name, value in outputs["terms"].items()}
        self.last_terms = terms
        if step % self.every_n_steps == 0:
            writer = self.tensorboard(trainer).experiment
            names = pl_module.delta_names()
            for name, value in terms.items():
                if name == "loss":
                    tag = "loss/total"
                elif name in _PROBABILITY_TAGS:
                    tag = _PROBABILITY_TAGS[name]
                elif name.startswith("norm/"):
                    tag = f"delta_norm/{names[int(name.split('/', 1)[1])]}"
                else:
                    tag = f"loss/{name}"
                writer.add_scalar(tag, value, step)
        if self.histogram_every_n_steps and step % self.histogram_every_n_steps == 0:
            self._histograms(trainer, pl_module, step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Final histograms, generations before/after as text, and hyperparameters with final metrics
        (rank zero)."""
        if not trainer.is_global_zero:
            return
        logger = self.tensorboard(trainer)
        step = max(trainer.global_step - 1, 0)
        self._histograms(trainer, pl_module, step)
        self.after = self._generate(pl_module)
        prompts = self._prompts(pl_module)
        if prompts and self.after:
            table = generations_table(prompts, self.before or [""] * len(prompts), self.after)
            logger.experiment.add_text("generations", table, step)
        describe = getattr(pl_module, "describe", dict)
        params = {**describe(), "max_steps": trainer.max_steps, "steps": trainer.global_step}
        metrics = {"hp/loss": self.last_terms.get("loss", float("nan"))}
        for name, tag in _PROBABILITY_TAGS.items():
            if name in self.last_terms:
                metrics[tag.replace("prob/", "hp/p_")] = self.last_terms[name]
        logger.log_hyperparams(params, metrics, step=step)
        logger.save()  # hparams.yaml
        logger.experiment.flush()


def generations_table(prompts: Sequence[str], before: Sequence[str], after: Sequence[str],
                      headers: tuple[str, str] = ("before", "after")) -> str:
    """A markdown table of each prompt with its continuation before and after an intervention."""
    lines = [f"| prompt | {headers[0]} | {headers[1]} |", "|---|---|---|"]
    for prompt, old, new in zip(prompts, before, after):
        lines.append(f"| {_cell(prompt)} | {_cell(old)} | {_cell(new)} |")
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Text fit for a markdown table cell (pipes escaped, newlines as spaces, spaces kept visible)."""
    return "`" + text.replace("|", "\\|").replace("\n", " ").replace("`", "'") + "`"

