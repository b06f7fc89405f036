from .attention import AttentionConfig as AttentionConfig
from .attention import AttentionSpec as AttentionSpec
from .attention import AttnQuantSpec as AttnQuantSpec
from .attention import BlockSparseSpec as BlockSparseSpec
from .attention import SkipSoftmaxSpec as SkipSoftmaxSpec
