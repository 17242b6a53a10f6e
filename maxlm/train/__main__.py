import sys

from maxlm.train import allocator

allocator.use_huge_pages()  # first, before jax is imported: the process may re-execute itself

from maxlm.posttrain import build_task  # noqa: E402  (TrainConfig.task = "sft" and later tasks)
from maxlm.train.pretrain import main  # noqa: E402

sys.exit(main(build_task=build_task))
