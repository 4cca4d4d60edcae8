# Sourced by pretrain_gpt.sbatch and join.sbatch: the GPU cluster's environment for every agent
# of a job. DEADPOOL_GPU=0 (a CPU cluster) leaves the environment as it is.
if [[ "${DEADPOOL_GPU:-1}" == 1 ]]; then
    # Perlmutter: the pytorch module (or a shifter image started with --module=gpu,nccl-plugin)
    # and the libfabric network plugin for NCCL; without it NCCL over Slingshot is 2-3x slower.
    module load pytorch 2>/dev/null || echo "deadpool: no 'pytorch' module; using ${PYTHON:-python} as is"
    module load nccl-plugin 2>/dev/null || true
    export FI_MR_CACHE_MONITOR=${FI_MR_CACHE_MONITOR:-userfaultfd}
    export FI_CXI_DISABLE_HOST_REGISTER=${FI_CXI_DISABLE_HOST_REGISTER:-1}
    export FI_CXI_DEFAULT_CQ_SIZE=${FI_CXI_DEFAULT_CQ_SIZE:-131072}
    export NCCL_NET_GDR_LEVEL=${NCCL_NET_GDR_LEVEL:-PHB}
    export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-1}
fi
