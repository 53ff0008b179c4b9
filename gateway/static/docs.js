// Renders /openapi.json: one card per operation, grouped by app (tag), with each argument's JSON type.
"use strict";

let components = {};

function resolve(schema) {
  while (schema && schema.$ref) schema = components[schema.$ref.split("/").pop()] || {};
  return schema || {};
}

function typeOf(raw) {
  const schema = resolve(raw);
  if (raw && raw.$ref) return raw.$ref.split("/").pop().split(".").pop();
  const union = schema.anyOf || schema.oneOf;
  if (union) return union.map(typeOf).join(" | ");
  if (schema.type === "array") return `array of ${typeOf(schema.items)}`;
  if (schema.type === "object" && schema.additionalProperties && typeof schema.additionalProperties === "object")
    return `object of ${typeOf(schema.additionalProperties)}`;
  if (schema.enum) return schema.enum.map((v) => JSON.stringify(v)).join(" | ");
  return schema.type || "any";
}

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;
  if (className) node.className = className;
  return node;
}

function fieldsTable(schema) {
  const object = resolve(schema);
  const names = Object.keys(object.properties || {});
  if (!names.length) return element("p", object.type === "object" ? "no arguments" : `body: ${typeOf(schema)}`,
                                    "muted");
  const table = element("table");
  const head = table.appendChild(element("tr"));
  for (const title of ["argument", "type", "required", "default"]) head.appendChild(element("th", title));
  const required = new Set(object.required || []);
  for (const name of names) {
    const property = object.properties[name];
    const row = table.appendChild(element("tr"));
    row.dataset.argument = name;
    row.appendChild(element("td", name));
    row.appendChild(element("td", typeOf(property), "type"));
    row.appendChild(element("td", required.has(name) ? "yes" : "no"));
    row.appendChild(element("td", "default" in property ? JSON.stringify(property.default) : ""));
  }
  return table;
}

function operationCard(path, verb, operation) {
  const card = element("div", undefined, "operation");
  card.dataset.path = path;
  card.appendChild(element("span", verb, "verb"));
  card.appendChild(element("span", path, "path"));
  if (operation.summary) card.appendChild(element("div", operation.summary, "muted"));
  const body = operation.requestBody && operation.requestBody.content["application/json"];
  if (body) card.appendChild(fieldsTable(body.schema));
  const ok = operation.responses && operation.responses["200"];
  const content = ok && ok.content && (ok.content["application/json"] || ok.content["text/event-stream"]);
  if (content) {
    const result = resolve(content.schema);
    const shown = result.properties && result.properties.result ? typeOf(result.properties.result) : typeOf(result);
    const line = element("div", "returns ", "muted");
    line.appendChild(element("code", ok.content["text/event-stream"] ? "server-sent events" : `{"result": ${shown}}`));
    card.appendChild(line);
  }
  return card;
}

// The functions an API key may call: the key comes in the page's fragment (/docs#key=ek_..., never sent to a
// server) or the form, and stays in this tab's sessionStorage; without one the page shows the gateway's routes.
function apiKey() {
  const given = new URLSearchParams(location.hash.slice(1)).get("key");
  if (given) {
    sessionStorage.setItem("ember-key", given);
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem("ember-key");
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem("ember-key", document.getElementById("key").value.trim());
  render().catch(failed);
});

async function render() {
  const main = document.getElementById("api");
  const key = apiKey();
  const reply = await fetch("/openapi.json", key ? {headers: {Authorization: `Bearer ${key}`}} : {});
  const spec = await reply.json();
  if (!reply.ok) throw new Error((spec.error && spec.error.message) || reply.status);
  document.getElementById("key-state").textContent = key ? "the functions this key may call"
    : "the gateway's routes; give an API key to see the functions it may call";
  components = (spec.components && spec.components.schemas) || {};
  const groups = new Map();
  for (const [path, verbs] of Object.entries(spec.paths)) {
    for (const [verb, operation] of Object.entries(verbs)) {
      if (path.endsWith("{path}") && verb !== "get") continue;  // an ASGI endpoint takes every method: shown once
      const group = (operation.tags && operation.tags[0]) || "gateway";
      if (!groups.has(group)) groups.set(group, []);
      groups.get(group).push(operationCard(path, path.endsWith("{path}") ? "any" : verb, operation));
    }
  }
  main.replaceChildren();
  for (const [group, cards] of [...groups.entries()].sort()) {
    const section = main.appendChild(element("section"));
    section.dataset.group = group;
    section.appendChild(element("h2", group === "gateway" ? "gateway" : `app ${group}`));
    for (const card of cards) section.appendChild(card);
  }
}

function failed(error) {
  document.getElementById("api").replaceChildren(element("p", `could not load /openapi.json: ${error.message}`));
}

render().catch(failed);
