# Serving pool: stock vLLM (CUDA) + this project's hot-swap worker extension and router.
# Replicas bind loopback (their dev-mode /collective_rpc must never be reachable), so the
# router runs in the same container (`adapt serve`) and is the only exposed port.
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_IMAGE}
ENV PYTHONUNBUFFERED=1 ADAPT_STATE_DIR=/state DRAFTER_ADAPT_HOME=/cache PYTHONPATH=/app
WORKDIR /app
COPY pyproject.toml ./
COPY adapt ./adapt
COPY capture ./capture
COPY serving ./serving
# vLLM, torch and transformers come with the base image; only the project's light deps here.
RUN pip install --no-cache-dir mlflow==3.17.2 duckdb pyarrow boto3 pydantic typer httpx safetensors gguf matplotlib
EXPOSE 8000
ENTRYPOINT ["python", "-m", "app"]
CMD ["serve", "--json"]
