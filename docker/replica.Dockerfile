# Serving pool: stock vLLM (CUDA) + this project's hot-swap worker extension and router.
# Replicas bind loopback (their dev-mode /collective_rpc must never be reachable), so the
# router runs in the same container (`adapt serve`) and is the only exposed port.
# The target model is not in this image: the `models` init service (worker image) converts it
# into the shared /cache volume before the pool starts.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
# HOME: vLLM, Triton and Hugging Face keep their caches under it; the user below owns it.
ENV PYTHONUNBUFFERED=1 ADAPT_STATE_DIR=/state DRAFTER_ADAPT_HOME=/cache PYTHONPATH=/app HOME=/home/adapt
# The stack's one user (uid 50000, gid 0; see worker.Dockerfile).
RUN useradd --uid 50000 --gid 0 --home-dir /home/adapt --create-home --shell /usr/sbin/nologin adapt \
 && mkdir -p /state /cache && chown 50000:0 /state /cache && chmod 0770 /state /cache
WORKDIR /app
COPY pyproject.toml ./
# vLLM, torch and transformers come with the base image; only the project's light deps here.
RUN python3 -m pip install --no-cache-dir mlflow==3.17.2 duckdb pyarrow boto3 pydantic typer httpx safetensors gguf matplotlib
# The project's packages (pyproject.toml's [tool.setuptools] list).
COPY settings ./settings
COPY capture ./capture
COPY traffic ./traffic
COPY headspec ./headspec
COPY targets ./targets
COPY adapt ./adapt
COPY serving ./serving
COPY evaluation ./evaluation
COPY rollout ./rollout
COPY loop ./loop
COPY app ./app
USER 50000:0
VOLUME ["/state", "/cache"]
EXPOSE 8000
# python3: the vLLM image's interpreter (it may have no `python`).
ENTRYPOINT ["python3", "-m", "app"]
CMD ["serve", "--json"]
