"""How pseudo-gradients go up and global params come down (docs/CODEC.md)."""

from __future__ import annotations

from typing import Literal

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


#: How global params reach a unit: the fragment's global copy, or a delta against the copy the
#: unit holds (shared/downlink.py).
ParamsDownlinkName = Literal["copy", "delta"]
#: Codecs a params delta may be sent in.
DeltaCodecName = Literal["int8", "int4", "int2"]


def narrower_delta_codec(upload_codec: CodecName) -> DeltaCodecName:
    """The default codec of params deltas for ``upload_codec``: one step narrower than the
    uploads, int4 at most. A unit receives about one delta per unit's upload, so the downlink
    carries more than the uplink; the outer's error feedback keeps int2 deltas as good as int4
    where the uploads are int4 (docs/CODEC.md, 'Cheaper downlinks')."""
    return "int2" if upload_codec in ("int4", "int2") else "int4"


class DownlinkSettings(BaseModel):
    """How a unit receives the global params (the learner's and the outer's shared choice)."""

    model_config = ConfigDict(extra="forbid")

    params_downlink: ParamsDownlinkName = Field(
        "delta",
        description="how global params reach a unit: 'copy' (every unit reads the global copy, "
        "in --params-codec) or 'delta' (the outer sends each unit a delta in "
        "--params-delta-codec against the copy the unit holds, keeping the quantization "
        "error; the global copy is the keyframe)",
    )


class ParamsCodecSettings(DownlinkSettings):
    """How the outer encodes the global params it publishes."""

    model_config = ConfigDict(extra="forbid")

    params_codec: ParamsCodecName = Field(
        "int8",
        description="codec of the global params sent to learners: int8 (blockwise, each "
        "version encoded afresh; a quarter of fp32's bytes), bf16 or fp32 (exact); "
        "BENCHMARKS.md, 'Quality: downlink', measures them",
    )
    params_delta_codec: DeltaCodecName = Field(
        narrower_delta_codec(CodecConfig.codec),
        description="codec of the params deltas with --params-downlink delta: int8, int4 or "
        "int2 (the outer carries each delta's quantization error into the next). Where the "
        "upload codec is set too (diloco up, a REST job), it defaults to one step narrower "
        "than the uploads, int4 at most: int2 with int4 or int2 uploads, int4 otherwise "
        "(docs/CODEC.md, 'Cheaper downlinks')",
    )


class CodecSettings(UploadCodecSettings, ParamsCodecSettings):
    """Both directions: the learners' upload codec and the outer's params codec. Unless set,
    the params delta codec follows the upload codec (:func:`narrower_delta_codec`)."""

    @model_validator(mode="after")
    def _delta_codec_follows_uploads(self) -> CodecSettings:
        if "params_delta_codec" not in self.model_fields_set:
            self.params_delta_codec = narrower_delta_codec(self.codec)
        return self
