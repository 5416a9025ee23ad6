"""torchrun's ``etcd3`` rendezvous backend: ``torchrun --rdzv-backend etcd3`` on our
etcd v3 rendezvous (see :mod:`elastic.torchrun.handler`).

The only part of ``elastic``'s control plane that imports torch: torch's
rendezvous interface and ``torch.distributed.Store`` are what it implements.
Nothing is imported here, so ``import elastic.torchrun`` stays cheap.
"""
