"""What a job trains: the model and its data, and how much each unit trains."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from shared.model_config import ModelSize, get_config
from shared.records import MAX_BATCH_SIZE, MAX_OUTER_UNITS

MAX_STEPS = 100_000_000  # inner steps a unit may be asked to train
#: Learner units of a job unless told otherwise (``diloco up --learners``, a REST job's
#: ``units``, a service's ``--num-units``).
DEFAULT_UNITS = 4


class DataSettings(BaseModel):
    """The model and the data it trains on: every learner and the outer of a job must agree."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: ModelSize = Field("small", description="model size: tiny, small, medium or large")
    seed: int = Field(
        0, ge=0, le=2**31 - 1, description="seed of the initial parameters and the data order"
    )
    corpus: str | None = Field(
        None,
        max_length=4096,
        description="text file or folder to train on (default: this Python's standard library)",
    )
    corpus_max_bytes: int | None = Field(
        None, gt=0, description="use only the first N bytes of the corpus (default: all)"
    )
    heldout_fraction: float = Field(
        0.02, gt=0, lt=0.5, description="tail share of the corpus held out for eval loss"
    )


class BudgetSettings(BaseModel):
    """How much one unit trains: its batch and its inner steps."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    batch_size: int = Field(16, ge=1, le=MAX_BATCH_SIZE, description="sequences per inner step")
    max_steps: int = Field(
        300, ge=1, le=MAX_STEPS, description="inner steps each unit trains (cosine horizon)"
    )


class WorkloadSettings(DataSettings, BudgetSettings):
    """The model, its data and each unit's budget."""

    def tokens_per_step(self) -> int:
        """Tokens one inner step of a unit trains: batch size × the model's context length."""
        return self.batch_size * get_config(self.model).seq_len


class UnitsSettings(BaseModel):
    """How many learner units a job has, as a service is told when it starts."""

    model_config = ConfigDict(extra="forbid")

    num_units: int = Field(
        DEFAULT_UNITS,
        ge=1,
        le=MAX_OUTER_UNITS,
        description="units in the job (the corpus is split into as many shards; the outer "
        "weights participation and sets the Delayed Nesterov period by it)",
    )
