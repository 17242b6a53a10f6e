import sys

from maxlm.train import allocator

allocator.use_huge_pages()  # first, before jax is imported: the process may re-execute itself

from maxlm.train.pretrain import main  # noqa: E402

sys.exit(main())
