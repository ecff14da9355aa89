// Load UI workflows into the real ComfyUI frontend (headless Chromium) and report what it made
// of them, for tests/test_workflows_browser.py.
//
//   node load_workflows.mjs <server url> <job.json>
//
// job.json: {"workflows": {name: ui_json_path}, "screenshots": dir or null}. Prints one JSON
// object: {name: {toasts, errors, missing, links, widgets, prompt, serialized, layout}}, where
// layout[graph] = {sizes: node sizes, wires: each link's drawn Beziers, one per leg}.
// Needs the npm package puppeteer-core and either @sparticuz/chromium or H3_CHROMIUM (the path of
// an installed Chromium); NODE_PATH may point at the packages.
import fs from 'node:fs'
import path from 'node:path'
import { createRequire } from 'node:module'

const require = createRequire(path.join(process.env.NODE_PATH || process.cwd(), 'x.js'))
const puppeteer = require('puppeteer-core')

const [server, jobPath] = process.argv.slice(2)
const job = JSON.parse(fs.readFileSync(jobPath, 'utf8'))

// H3_CHROMIUM names an installed Chromium (e.g. /usr/bin/chromium from apt); otherwise
// @sparticuz/chromium's bundled one, whose --single-process breaks a second page. The rest keeps
// the browser quiet and offline.
const quiet = ['--no-sandbox', '--disable-gpu', '--disable-background-networking',
  '--disable-component-update', '--disable-sync']
let executablePath = process.env.H3_CHROMIUM
let chromiumArgs = ['--headless=new', '--disable-dev-shm-usage', ...quiet]
if (!executablePath) {
  const chromium = require('@sparticuz/chromium')
  const args = chromium.default?.args ?? chromium.args
  chromiumArgs = args.filter((a) => a !== '--single-process').concat(quiet)
  executablePath = await (chromium.default ?? chromium).executablePath()
}
const browser = await puppeteer.launch({
  args: chromiumArgs, executablePath, headless: true,
  defaultViewport: { width: 1800, height: 1100 }
})

// Runs in the page: everything the test asserts on, read from the frontend's own objects.
async function loadOne(name, ui) {
  const app = window.app
  // Wires as the canvas draws them: each graph is shown (a subgraph opened), fitted into the
  // view so that no wire is culled and drawn once while Path2D records every Bezier; each
  // link's legs are the paths the canvas stored on its reroutes and on the link.
  async function drawnWires(graph) {
    const canvas = app.canvas
    if (graph !== app.rootGraph) {
      const host = app.rootGraph.nodes.find((n) => n.isSubgraphNode?.() && n.subgraph === graph)
      canvas.openSubgraph(graph, host)
    }
    await new Promise((r) => setTimeout(r, 200))
    const xs = [], ys = []
    for (const n of graph.nodes) { xs.push(n.pos[0], n.pos[0] + n.size[0]); ys.push(n.pos[1] - 40, n.pos[1] + n.size[1]) }
    for (const io of [graph.inputNode, graph.outputNode]) {
      const box = io?.boundingRect
      if (box) { xs.push(box[0], box[0] + box[2]); ys.push(box[1], box[1] + box[3]) }
    }
    for (const r of graph.reroutes?.values?.() ?? []) { xs.push(r.pos[0]); ys.push(r.pos[1]) }
    const [x0, x1, y0, y1] = [Math.min(...xs) - 400, Math.max(...xs) + 400, Math.min(...ys) - 400, Math.max(...ys) + 400]
    const scale = 0.5 * Math.min(canvas.canvas.clientWidth / (x1 - x0), canvas.canvas.clientHeight / (y1 - y0))
    canvas.ds.scale = scale
    canvas.ds.offset[0] = -x0
    canvas.ds.offset[1] = -y0
    const recorded = new Map()
    const proto = Path2D.prototype
    const { moveTo, bezierCurveTo } = proto
    proto.moveTo = function (x, y) { recorded.set(this, { from: [x, y], beziers: [] }); return moveTo.call(this, x, y) }
    proto.bezierCurveTo = function (...a) {
      const r = recorded.get(this)
      if (r) r.beziers.push([r.from, [a[0], a[1]], [a[2], a[3]], [a[4], a[5]]])
      return bezierCurveTo.apply(this, a)
    }
    try {
      canvas.setDirty(true, true)
      canvas.draw(true, true)
    } finally {
      proto.moveTo = moveTo
      proto.bezierCurveTo = bezierCurveTo
    }
    const legsOf = (segment) => recorded.get(segment?.path)?.beziers ?? null
    const out = {}
    for (const link of graph.links.values()) {
      const chain = []
      let id = link.parentId
      while (id !== undefined) { const r = graph.reroutes.get(id); chain.unshift(r); id = r.parentId }
      const legs = [...chain.map(legsOf), legsOf(link)]
      out[link.id] = legs.every((l) => l && l.length === 1) ? legs.map((l) => l[0]) : null
    }
    if (graph !== app.rootGraph) canvas.setGraph(app.rootGraph)
    return out
  }
  // Node boxes as the editor sized them (it grows a node its widgets do not fit).
  function nodeSizes(graph) {
    for (const node of graph.nodes) {
      node._setConcreteSlots()
      if (!node.collapsed) node.arrange()
    }
    return Object.fromEntries(graph.nodes.map((n) => [n.id, [...n.size]]))
  }
  const vue = [...document.querySelectorAll('*')].find((e) => e.__vue_app__).__vue_app__
  // 1.58.1 keeps its toasts in `toasts`; 1.49.6 passes each one on from `messagesToAdd` at
  // once, so every toast added while loading is recorded as it is added.
  const toastStore = vue.config.globalProperties.$pinia._s.get('toast')
  if (toastStore.dismissAll) toastStore.dismissAll()
  else toastStore.removeAll()
  const added = []
  const add = toastStore.add
  toastStore.add = (t) => { added.push(t); return add(t) }
  const errors = []
  const origError = console.error
  console.error = (...a) => { errors.push(a.map(String).join(' ')); origError(...a) }
  try {
    await app.loadGraphData(ui, true, true, name)
  } finally {
    console.error = origError
  }
  await new Promise((r) => setTimeout(r, 500))
  const graphs = [app.rootGraph, ...app.rootGraph.subgraphs.values()]
  const missing = []
  const links = []
  const widgets = {}
  for (const graph of graphs) {
    const where = graph === app.rootGraph ? 'root' : graph.id
    for (const node of graph.nodes) {
      const registered = window.LiteGraph.registered_node_types[node.type]
      if (!registered && !node.isSubgraphNode?.()) missing.push(node.type)
      widgets[`${where}/${node.id}`] = (node.widgets || [])
        .filter((w) => w.serialize !== false)
        .map((w) => [w.name, w.value ?? null])
    }
    for (const link of graph.links.values()) {
      const target = graph.getNodeById(link.target_id)
      const origin = graph.getNodeById(link.origin_id)
      const input = target?.inputs?.[link.target_slot]
      links.push({
        graph: where, id: link.id, origin_id: link.origin_id, origin_slot: link.origin_slot,
        target_id: link.target_id, target_slot: link.target_slot,
        input: input ? input.name : (Number(link.target_id) === -20 ? `output:${link.target_slot}` : null),
        input_link: input ? input.link : null,
        output: origin?.outputs?.[link.origin_slot]?.name ??
          (Number(link.origin_id) === -10 ? `input:${link.origin_slot}` : null)
      })
    }
  }
  const layout = {}
  for (const graph of graphs) {
    const where = graph === app.rootGraph ? 'root' : graph.id
    layout[where] = { sizes: nodeSizes(graph), wires: await drawnWires(graph) }
  }
  const prompt = (await app.graphToPrompt()).output
  toastStore.add = add
  const shown = toastStore.toasts ?? added
  const toasts = shown.map((t) => ({ kind: t.kind ?? t.severity, title: t.title ?? t.summary,
    description: t.description ?? t.detail ?? '' }))
  return { toasts, errors, missing, links, widgets, prompt, layout,
    serialized: app.rootGraph.serialize() }
}

async function screenshot(page, file, intoSubgraph) {
  // First-run dialogs (the template browser) would cover the graph.
  for (let i = 0; i < 3; i++) await page.keyboard.press('Escape')
  // The subgraph is wide: a larger viewport keeps its text readable in the picture.
  await page.setViewport(intoSubgraph ? { width: 4800, height: 1700 } : { width: 1800, height: 1100 })
  await page.evaluate(async (inside) => {
    const app = window.app
    app.canvas.min_font_size_for_lod = 0 // draw titles and widgets at any zoom
    if (inside) {
      const host = app.rootGraph.nodes.find((n) => n.isSubgraphNode?.())
      app.canvas.openSubgraph(host.subgraph, host)
    }
    await new Promise((r) => setTimeout(r, 300))
    const ds = app.canvas.ds
    const nodes = app.canvas.graph.nodes
    const xs = nodes.flatMap((n) => [n.pos[0], n.pos[0] + n.size[0]])
    const ys = nodes.flatMap((n) => [n.pos[1] - 40, n.pos[1] + n.size[1]])
    for (const io of [app.canvas.graph.inputNode, app.canvas.graph.outputNode]) {
      const box = io?.boundingRect
      if (box) { xs.push(box[0], box[0] + box[2]); ys.push(box[1], box[1] + box[3]) }
    }
    const groups = app.canvas.graph.groups ?? []
    for (const g of groups) { xs.push(g._bounding[0], g._bounding[0] + g._bounding[2]); ys.push(g._bounding[1], g._bounding[1] + g._bounding[3]) }
    const [x0, x1, y0, y1] = [Math.min(...xs) - 180, Math.max(...xs) + 180,
      Math.min(...ys) - 40, Math.max(...ys) + 40]
    const canvas = app.canvas.canvas
    const scale = Math.min(canvas.width / (x1 - x0), canvas.height / (y1 - y0))
    ds.scale = scale
    ds.offset[0] = -x0 + (canvas.width / scale - (x1 - x0)) / 2
    ds.offset[1] = -y0 + (canvas.height / scale - (y1 - y0)) / 2
    app.canvas.setDirty(true, true)
    app.canvas.draw(true, true)
    await new Promise((r) => setTimeout(r, 500))
  }, intoSubgraph)
  const canvas = await page.$('#graph-canvas')
  await (canvas ?? page).screenshot({ path: file })
  if (intoSubgraph) {
    await page.evaluate(() => { const app = window.app; app.canvas.setGraph(app.rootGraph) })
    await page.setViewport({ width: 1800, height: 1100 })
  }
}

const out = {}
try {
  const page = await browser.newPage()
  await page.goto(server, { waitUntil: 'networkidle2', timeout: 180000 })
  await page.waitForFunction(() => window.app?.rootGraph && window.LiteGraph, { timeout: 180000 })
  await page.evaluate(async () => {
    const settings = window.app.extensionManager.setting
    await settings.set('Comfy.Validation.Workflows', true)
    await settings.set('Comfy.Minimap.Visible', false)
    await settings.set('Comfy.TutorialCompleted', true)
  })
  for (const [name, file] of Object.entries(job.workflows)) {
    const ui = JSON.parse(fs.readFileSync(file, 'utf8'))
    out[name] = await page.evaluate(loadOne, name, ui)
    out[name].validation_setting = await page.evaluate(
      () => window.app.extensionManager.setting.get('Comfy.Validation.Workflows'))
    if (job.screenshots) {
      await screenshot(page, path.join(job.screenshots, `${name}.png`), false)
      await screenshot(page, path.join(job.screenshots, `${name}_inside.png`), true)
    }
  }
} finally {
  await browser.close()
}
process.stdout.write(JSON.stringify(out))
