"""How pseudo-gradients go up and global params come down (docs/CODEC.md)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from shared.codec.config import CODECS, CodecConfig, CodecError, CodecName
from shared.outer_choices import ParamsCodecName


class UploadCodecSettings(BaseModel):
    """How a learner encodes its pseudo-gradients."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    codec: CodecName = Field(
        CodecConfig.codec, description=f"pseudo-gradient codec, one of {', '.join(CODECS)}"
    )
    block_size: int = Field(
        CodecConfig.block_size,
        ge=16,
        le=1 << 20,
        description="quantization block size (a multiple of 16)",
    )
    zstd_level: int = Field(
        CodecConfig.zstd_level,
        ge=-7,
        le=22,
        description="zstd level of uploads (negative: faster, larger)",
    )
    # Off by default: with the default (Nesterov) outer step it made int2 worse in
    # bench/quality.py --codecs; it helps with --outer-momentum 0 (docs/CODEC.md).
    error_feedback: bool = Field(
        CodecConfig.error_feedback,
        description="carry each upload's quantization error into the next upload",
    )

    @model_validator(mode="after")
    def _check_codec(self) -> UploadCodecSettings:
        try:
            self.codec_config()
        except CodecError as err:
            raise ValueError(str(err)) from err
        return self

    def codec_config(self, threads: int = 0) -> CodecConfig:
        """The upload codec these settings describe (``threads``: see ``CodecConfig``)."""
        return CodecConfig(
            self.codec, self.block_size, self.zstd_level, threads, self.error_feedback
        )


class ParamsCodecSettings(BaseModel):
    """How the outer encodes the global params it publishes."""

    model_config = ConfigDict(extra="forbid")

    params_codec: ParamsCodecName = Field(
        "int8",
        description="codec of the global params sent to learners: int8 (blockwise, each "
        "version encoded afresh; a quarter of fp32's bytes), bf16 or fp32 (exact); "
        "BENCHMARKS.md, 'Quality: downlink', measures them",
    )


class CodecSettings(UploadCodecSettings, ParamsCodecSettings):
    """Both directions: the learners' upload codec and the outer's params codec."""
