# One image for every Tangram processor (the application environment).
# docker compose runs it once per processor: `tangram run <topology> <processor>`.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY streams ./streams
COPY inference_workers ./inference_workers
RUN pip install --no-cache-dir .
COPY schemas ./schemas
COPY topologies ./topologies
ENTRYPOINT ["tangram"]
