# Image for k8s/rayservice.yaml: Ray 2.60 (CUDA) + vLLM + MPIC serve.
#   docker build -f k8s/Dockerfile -t mpic-serve:0.1.0 .
FROM rayproject/ray:2.60.0-py311-gpu
WORKDIR /opt/mpic
COPY --chown=ray:users . /opt/mpic
RUN pip install --no-cache-dir ".[gpu]"
