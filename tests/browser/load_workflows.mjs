// Load UI workflows into the real ComfyUI frontend (headless Chromium) and report what it made
// of them, for tests/test_workflows_browser.py.
//
//   node load_workflows.mjs <server url> <job.json>
//
// job.json: {"workflows": {name: ui_json_path}, "screenshots": dir or null}. Prints one JSON
// object: {name: {toasts, errors, missing, links, widgets, prompt, serialized}}.
// Needs the npm packages @sparticuz/chromium and puppeteer-core (NODE_PATH may point at them).
import fs from 'node:fs'
import path from 'node:path'
import { createRequire } from 'node:module'

const require = createRequire(path.join(process.env.NODE_PATH || process.cwd(), 'x.js'))
const chromium = require('@sparticuz/chromium')
const puppeteer = require('puppeteer-core')

const [server, jobPath] = process.argv.slice(2)
const job = JSON.parse(fs.readFileSync(jobPath, 'utf8'))

// @sparticuz/chromium's --single-process breaks a second page; the rest keeps the browser quiet
// and offline.
const args = chromium.default?.args ?? chromium.args
const chromiumArgs = args
  .filter((a) => a !== '--single-process')
  .concat(['--no-sandbox', '--disable-gpu', '--disable-background-networking',
    '--disable-component-update', '--disable-sync'])
const executablePath = await (chromium.default ?? chromium).executablePath()
const browser = await puppeteer.launch({
  args: chromiumArgs, executablePath, headless: true,
  defaultViewport: { width: 1800, height: 1100 }
})

// Runs in the page: everything the test asserts on, read from the frontend's own objects.
async function loadOne(name, ui) {
  const app = window.app
  // Wires as the canvas draws them (cubic splines leaving outputs to the right and entering
  // inputs from the left), sampled: crossings between wires and overlaps between nodes.
  function wireLayout(graph) {
    const ends = (pos) => [pos[0], pos[1]]
    const slotPos = (io, index) => io?.slots?.[index]?.pos
    const curves = []
    for (const link of graph.links.values()) {
      const origin = Number(link.origin_id) === -10 ? null : graph.getNodeById(link.origin_id)
      const target = Number(link.target_id) === -20 ? null : graph.getNodeById(link.target_id)
      const a = origin ? origin.getOutputPos(link.origin_slot) : slotPos(graph.inputNode, link.origin_slot)
      const b = target ? target.getInputPos(link.target_slot) : slotPos(graph.outputNode, link.target_slot)
      if (!a || !b) continue
      const [ax, ay] = ends(a)
      const [bx, by] = ends(b)
      const d = Math.max(30, Math.hypot(bx - ax, by - ay) * 0.25)
      const pts = []
      for (let i = 0; i <= 24; i++) {
        const t = i / 24, u = 1 - t
        pts.push([u * u * u * ax + 3 * u * u * t * (ax + d) + 3 * u * t * t * (bx - d) + t * t * t * bx,
          u * u * u * ay + 3 * u * u * t * ay + 3 * u * t * t * by + t * t * t * by])
      }
      curves.push({ id: link.id, from: `${link.origin_id}:${link.origin_slot}`, pts })
    }
    const cross = (p, q, r, s) => {
      const d = (q[0] - p[0]) * (s[1] - r[1]) - (q[1] - p[1]) * (s[0] - r[0])
      if (Math.abs(d) < 1e-9) return false
      const t = ((r[0] - p[0]) * (s[1] - r[1]) - (r[1] - p[1]) * (s[0] - r[0])) / d
      const v = ((r[0] - p[0]) * (q[1] - p[1]) - (r[1] - p[1]) * (q[0] - p[0])) / d
      return t > 0.02 && t < 0.98 && v > 0.02 && v < 0.98
    }
    const crossings = []
    for (let i = 0; i < curves.length; i++) {
      for (let j = i + 1; j < curves.length; j++) {
        const A = curves[i], B = curves[j]
        if (A.from === B.from) continue // wires of one output share their start
        let hit = false
        for (let k = 0; k < 24 && !hit; k++)
          for (let m = 0; m < 24 && !hit; m++)
            hit = cross(A.pts[k], A.pts[k + 1], B.pts[m], B.pts[m + 1])
        if (hit) crossings.push([A.id, B.id])
      }
    }
    const boxes = graph.nodes.map((n) => [n.id, n.pos[0], n.pos[1] - 30, n.pos[0] + n.size[0], n.pos[1] + n.size[1]])
    const overlaps = []
    for (let i = 0; i < boxes.length; i++)
      for (let j = i + 1; j < boxes.length; j++) {
        const [a, ax0, ay0, ax1, ay1] = boxes[i], [b, bx0, by0, bx1, by1] = boxes[j]
        if (ax0 < bx1 && bx0 < ax1 && ay0 < by1 && by0 < ay1) overlaps.push([a, b])
      }
    const sizes = Object.fromEntries(graph.nodes.map((n) => [n.id, [...n.size]]))
    return { crossings, overlaps, sizes }
  }
  const vue = [...document.querySelectorAll('*')].find((e) => e.__vue_app__).__vue_app__
  const toastStore = vue.config.globalProperties.$pinia._s.get('toast')
  toastStore.dismissAll()
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
  for (const graph of graphs) layout[graph === app.rootGraph ? 'root' : graph.id] = wireLayout(graph)
  const prompt = (await app.graphToPrompt()).output
  const toasts = toastStore.toasts.map((t) => ({ kind: t.kind, title: t.title,
    description: t.description ?? '' }))
  return { toasts, errors, missing, links, widgets, prompt, layout,
    serialized: app.rootGraph.serialize() }
}

async function screenshot(page, file, intoSubgraph) {
  // First-run dialogs (the template browser) would cover the graph.
  for (let i = 0; i < 3; i++) await page.keyboard.press('Escape')
  // The subgraph is wide: a larger viewport keeps its text readable in the picture.
  await page.setViewport(intoSubgraph ? { width: 3200, height: 1300 } : { width: 1800, height: 1100 })
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
