# Router/controller image: `adapt controller` (registry → pool reconcile, live-acceptance watch).
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 ADAPT_STATE_DIR=/state DRAFTER_ADAPT_HOME=/cache
WORKDIR /app
COPY pyproject.toml ./
COPY adapt ./adapt
COPY capture ./capture
COPY serving ./serving
# The controller validates heads (torch, CPU wheels suffice) but never runs a model.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu "." \
 && pip uninstall -y torchvision torchaudio torchcodec || true
EXPOSE 8090
ENTRYPOINT ["adapt"]
CMD ["controller", "--health-host", "0.0.0.0", "--health-port", "8090"]
